"""Tiny random DeepSeek-V3 and GLM-4.5 checkpoints built by transformers itself (the oracle), saved
with save_pretrained into a test's temp dir together with the bundled tokenizer (docs/deepseek.md).

Both: four layers, the first dense (`first_k_dense_replace=1`), eight routed experts and one shared
expert, sigmoid scores with a non-zero `e_score_correction_bias`, a routed scaling factor != 1.
DeepSeek-V3 (`deepseek_v3`): multi-head latent attention with q_lora_rank (or without: `q_lora=False`),
value heads narrower than q/k heads, YaRN with mscale, grouped routing (4 groups, the best 2).
GLM-4.5 (`glm4_moe`): partial rotary (half the head), q/k/v biases, q/k norms, GQA.
Weights are drawn with O(1) activations so that a wrong mapping shows in the logits, and the
router wide enough that the top-k choice is not decided by rounding.

`with_mtp` appends a multi-token-prediction layer's tensors (`model.layers.<num_layers>.*`, as
DeepSeek publishes them) in a shard of their own: transformers ignores them, ftcore carries them
into its export.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.support.hf_helpers import VOCAB, randomize, save_with_tokenizer

FAMILIES = ("deepseek_v3", "glm4_moe")
EXPERTS, TOPK = 8, 4


def tiny_config(family: str = "deepseek_v3", vocab: int = VOCAB, q_lora: bool = True, **over):
    import transformers

    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256,
              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=2032, eos_token_id=2033,
              n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=TOPK,
              first_k_dense_replace=1, norm_topk_prob=True)  # fmt: skip
    if family == "deepseek_v3":
        kw.update(num_key_value_heads=4, q_lora_rank=48 if q_lora else None, kv_lora_rank=32,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_group=4, topk_group=2,
                  routed_scaling_factor=2.5,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.7})  # fmt: skip
        cls = transformers.DeepseekV3Config
    elif family == "glm4_moe":
        kw.update(num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True,
                  n_group=1, topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.5,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                   "partial_rotary_factor": 0.5})  # fmt: skip
        cls = transformers.Glm4MoeConfig
    else:
        raise ValueError(f"not a DeepSeek-V3-class family: {family}")
    kw.update(over)
    return cls(**kw)


@torch.no_grad()
def make_tiny(path: str | Path, family: str = "deepseek_v3", *, seed: int = 0, q_lora: bool = True,
              with_mtp: bool = False, max_shard_size: str = "150KB", **over) -> Path:  # fmt: skip
    """A random `family` model saved in shards (with an index) plus a Llama-3 base tokenizer."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, q_lora=q_lora, **over))
    randomize(model)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn_like(b))
    path = save_with_tokenizer(model, path, max_shard_size)
    if with_mtp:
        add_mtp_layer(path, model.config)
    return path


MTP_SHARD = "model-mtp.safetensors"


def mtp_tensors(config) -> dict[str, torch.Tensor]:
    """One multi-token-prediction layer as DeepSeek-V3 publishes it, after the last layer: its
    norms and projection, a decoder layer's attention and a dense MLP (random, bf16)."""
    g = torch.Generator().manual_seed(5)
    h, n = config.hidden_size, config.num_hidden_layers
    p = f"model.layers.{n}."
    shapes = {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
              "shared_head.norm.weight": (h,), "input_layernorm.weight": (h,),
              "self_attn.o_proj.weight": (h, h), "mlp.gate_proj.weight": (16, h)}  # fmt: skip
    return {p + k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in shapes.items()}


def add_mtp_layer(path: Path, config) -> None:
    """Write mtp_tensors into a shard of their own and list them in the index."""
    from safetensors.torch import save_file

    tensors = mtp_tensors(config)
    save_file(tensors, str(path / MTP_SHARD), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"].update({k: MTP_SHARD for k in tensors})
    index.write_text(json.dumps(data, indent=2))


def to_fp8(src: str | Path, out: str | Path, block=(8, 8)) -> Path:
    """The checkpoint at `src` in DeepSeek's published FP8 format: every weight that format holds
    in FP8 (hf/fp8.py `quantized`) as float8_e4m3fn with a float32 `weight_scale_inv` per block,
    the expert bias in fp32, everything else in bf16, `quantization_config` in config.json. One
    safetensors file."""
    import shutil

    from safetensors.torch import save_file

    from ftcore.hf import fp8
    from tests.support.hf_helpers import read_hf_dir

    src, out = Path(src), Path(out)
    out.mkdir(parents=True)
    tensors = {}
    for name, t in read_hf_dir(src).items():
        if fp8.quantized(name) and t.dim() == 2:
            tensors[name], tensors[name + fp8.SCALE] = fp8.quantize(t, block)
        else:
            keep = name.endswith("e_score_correction_bias")
            tensors[name] = t.float() if keep else t.to(torch.bfloat16)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config.update(fp8.config_keys(block))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
