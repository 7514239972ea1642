"""LoRA on a mixture of experts in PEFT's format (peft/moe_format.py): adapters under ftcore's names
(every expert its own A and B, the router, a dense MLP layer, attention) written by to_peft +
save_adapter are what PEFT 0.21.2 applies on transformers' own Qwen3-MoE and Mixtral: the PEFT
model gives the logits of the base with W + scale*B*A merged per expert (ftcore's HF-layout
merge), and the megatron-layout merge is scale*B*A per expert in [gate; up] order."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from ftcore.errors import FtcoreError
from ftcore.peft.adapter_format import read_adapter, save_adapter, to_peft
from ftcore.peft.config import Geometry, LoraSettings, check_config, settings
from ftcore.peft.merge import megatron_deltas, write_merged_model
from tests.support.hf_helpers import hf_model, tokens
from tests.support.moe import NUM_EXPERTS, make_tiny_moe

R, ALPHA = 2, 4.0
GEO = {  # the tiny models of tests/support/moe.py
    "qwen3_moe": Geometry(64, 96, 4, 2, 32, NUM_EXPERTS, 48),
    "mixtral": Geometry(64, 48, 4, 2, 16, NUM_EXPERTS, 48),
}
DENSE = {"qwen3_moe": [1], "mixtral": []}


def our_adapters(geo: Geometry, layers: int, dense: list[int], shared: bool, seed: int = 0):
    """Random adapters by ftcore's global names: q_proj, the router, and the MLP (experts, or the
    dense MLP); `shared`: one A for gate and up (linear_fc1, megatron's name)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return 0.3 * torch.randn(*shape, generator=g)

    def mlp(pre: str, e: Geometry) -> dict:
        out = {}
        for s in ("gate_proj", "up_proj"):
            out[pre + f"linear_fc1.lora_A.{'linear_fc1' if shared else s}"] = rnd(R, e.hidden)
            out[pre + f"linear_fc1.lora_B.{s}"] = rnd(e.ffn, R)
        out[pre + "linear_fc2.lora_A.down_proj"] = rnd(R, e.ffn)
        out[pre + "linear_fc2.lora_B.down_proj"] = rnd(e.hidden, R)
        return out

    full = {}
    for i in range(layers):
        full[f"decoder.layers.{i}.self_attention.linear_qkv.lora_A.q_proj"] = rnd(R, geo.hidden)
        full[f"decoder.layers.{i}.self_attention.linear_qkv.lora_B.q_proj"] = rnd(
            geo.heads * geo.head_dim, R
        )
        if i in dense:
            full.update(mlp(f"decoder.layers.{i}.mlp.", geo))
            continue
        full[f"decoder.layers.{i}.mlp.router.lora_A.gate"] = rnd(R, geo.hidden)
        full[f"decoder.layers.{i}.mlp.router.lora_B.gate"] = rnd(geo.experts, R)
        for k in range(geo.experts):
            full.update(mlp(f"decoder.layers.{i}.mlp.experts.local_experts.{k}.", geo.expert()))
    return full


def model_cfg(family: str):
    return OmegaConf.create({"family": family, "num_experts": NUM_EXPERTS,
                             "moe_dense_layers": DENSE[family]})  # fmt: skip


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_peft_applies_what_ftcore_writes(family, tmp_path):
    from peft import PeftModel

    base = make_tiny_moe(tmp_path / "base", family)
    full = our_adapters(GEO[family], 4, DENSE[family], shared=family == "mixtral")
    sd, targets = to_peft(full, family)
    if family == "mixtral":  # the published per-expert names, w1/w3/w2 in block_sparse_moe
        assert "base_model.model.model.layers.0.block_sparse_moe.experts.3.w3.lora_B.weight" in sd
    else:
        assert sd["base_model.model.model.layers.2.mlp.experts.3.up_proj.lora_A.weight"].shape == (
            R, 64)  # fmt: skip
    s = LoraSettings(R, ALPHA, 0.0, tuple(targets), False)
    save_adapter(tmp_path / "ad", sd, s, targets, str(base), model_cfg(family))
    config, _ = read_adapter(tmp_path / "ad")
    x = tokens(batch=2, seq=16)
    with torch.no_grad():
        got = PeftModel.from_pretrained(hf_model(base), str(tmp_path / "ad")).eval()
        got = got(input_ids=x).logits
        merged = write_merged_model(base, tmp_path / "ad", tmp_path / "merged")
        want = hf_model(merged)(input_ids=x).logits
        plain = hf_model(base)(input_ids=x).logits
    assert _rel(plain, want) > 1e-3, "the adapter changed nothing: the test would prove nothing"
    assert _rel(got, want) <= 1e-5, f"{family}: PEFT's model and the merged one differ"
    # read back as ftcore's settings: Mixtral's w1/w3/w2 are gate/up/down_proj again
    cfg = OmegaConf.create({"peft": {"name": "lora", "r": 8, "lora_alpha": 1.0, "lora_dropout": 0.0,
                                     "target_modules": ["q_proj"], "use_rslora": False,
                                     "adapter_path": str(tmp_path / "ad")}})  # fmt: skip
    assert set(settings(cfg).targets) == set(targets)
    assert config["target_parameters"] == (
        ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        if DENSE[family] else None
    )  # fmt: skip


def test_megatron_merge_per_expert():
    """scale*B@A of each expert, [gate; up] stacked as megatron's linear_fc1."""
    geo = GEO["mixtral"]
    full = our_adapters(geo, 1, [], shared=False)
    deltas = megatron_deltas(full, geo, 2.0)
    pre = "decoder.layers.0.mlp.experts.local_experts.3."
    fc1 = deltas[pre + "linear_fc1.weight"]
    gate, up = (2.0 * full[pre + f"linear_fc1.lora_B.{s}"] @ full[pre + f"linear_fc1.lora_A.{s}"]
                for s in ("gate_proj", "up_proj"))  # fmt: skip
    torch.testing.assert_close(fc1, torch.cat([gate, up]))
    a, b = full[pre + "linear_fc2.lora_A.down_proj"], full[pre + "linear_fc2.lora_B.down_proj"]
    torch.testing.assert_close(deltas[pre + "linear_fc2.weight"], 2.0 * b @ a)
    router = deltas["decoder.layers.0.mlp.router.weight"]
    assert router.shape == (NUM_EXPERTS, 64)


def _cfg(**peft):
    p = {"name": "lora", "r": 4, "lora_alpha": 8.0, "lora_dropout": 0.0, "use_rslora": False,
         "adapter_path": None, "target_modules": ["gate_proj", "up_proj", "down_proj"], **peft}  # fmt: skip
    return OmegaConf.create({
        "peft": p, "precision": {"fp8_recipe": None, "fp4_recipe": None},
        "model": {"family": "qwen3_moe", "num_experts": 4, "moe_dense_layers": []}})  # fmt: skip


@pytest.mark.parametrize(
    "over, field",
    [
        ({"name": "qlora", "double_quant": True}, "peft.name"),
        ({"target_modules": ["gate_proj", "down_proj"]}, "peft.target_modules"),
        ({"lora_dropout": 0.1}, "peft.lora_dropout"),
        ({"use_rslora": True}, "peft.use_rslora"),
    ],
)
def test_moe_lora_refusals(over, field):
    with pytest.raises(FtcoreError) as e:
        check_config(_cfg(**over))
    assert e.value.field == field and e.value.fix
    check_config(_cfg())  # the defaults pass


def test_router_on_a_dense_model_is_refused():
    cfg = _cfg(target_modules=["q_proj", "gate"])
    cfg.model.num_experts = None
    with pytest.raises(FtcoreError, match="dense"):
        check_config(cfg)


def test_experts_on_te_take_adapters_with_etp_1():
    """Issue 50 item 13: expert targets on a GPU with TE layers were refused (fix: te_layers=false,
    which built the local spec for the whole model). Now TE's spec builds the experts one module
    each (models/moe.py), which the adapters wrap; etp > 1 is refused there (megatron hands TE's
    expert linears no expert TP group)."""
    cfg = _cfg()
    cfg.cluster = {"device": "cuda"}
    check_config(cfg)
    cfg.parallel = {"etp": 2}
    with pytest.raises(FtcoreError) as e:
        check_config(cfg)
    assert e.value.field == "parallel.etp" and "etp=1" in e.value.fix
    cfg.precision.te_layers = False  # SequentialMLP of local linears
    check_config(cfg)
    cfg.precision.te_layers, cfg.peft.target_modules = True, ["q_proj", "gate"]  # no expert
    check_config(cfg)


def test_adapter_of_another_base_or_fused_layout_refused_before_build(tmp_path):
    """peft.adapter_path: expert tensors of another shape, experts the model lacks, and PEFT's
    fused transformers-5 layout are refused by the config checks (nothing built)."""
    from safetensors.torch import save_file

    from ftcore.peft.adapter_config import write_adapter_config

    pre = "base_model.model.model.layers.0.mlp.experts."
    cases = {
        "shape": {pre + "1.down_proj.lora_A.weight": torch.zeros(R, 47)},
        "expert": {pre + "4.down_proj.lora_A.weight": torch.zeros(R, 48)},
        "fused": {pre + "base_layer.lora_A.weight": torch.zeros(4 * 2 * R, 64)},
    }
    for name, sd in cases.items():
        d = tmp_path / name
        d.mkdir()
        save_file(sd, str(d / "adapter_model.safetensors"))
        write_adapter_config(
            d, LoraSettings(R, ALPHA, 0.0, ("down_proj",), False), ["down_proj"], None
        )
        cfg = _cfg(adapter_path=str(d))
        cfg.model.update({"num_layers": 2, "hidden_size": 64, "ffn_hidden_size": 96,
                          "moe_ffn_hidden_size": 48, "num_attention_heads": 4,
                          "num_query_groups": 2, "kv_channels": 16})  # fmt: skip
        with pytest.raises(FtcoreError) as e:
            check_config(cfg)
        assert e.value.field == "peft.adapter_path", name
        assert ("fused" in str(e.value)) == (name == "fused"), name
