"""Hugging Face `config.json` <-> the `model` config section.

Reading fills cfg.model from a local HF directory (shapes, GQA, head dim, vocab, rope theta and all
four llama3 rope_scaling fields, rms eps, tied embeddings) and refuses what ftcore cannot represent
exactly (other architectures, biases, other activations or rope types). Both the transformers 4.x
(`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are read; export writes the
4.x spelling, which every version reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from ftcore.errors import FtcoreError

ARCHITECTURES = ("LlamaForCausalLM",)
ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def hf_dir(path: str, field: str = "model.hf_path") -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FtcoreError(f"{p} is not a directory", field=field,
                          fix="point it at a local Hugging Face model directory (config.json + *.safetensors)")  # fmt: skip
    return p


def read_hf_config(path: str, field: str = "model.hf_path") -> dict:
    """config.json of an HF directory, checked to be a Llama ftcore can load exactly."""
    f = hf_dir(path, field) / "config.json"
    if not f.is_file():
        raise FtcoreError(f"{f} is missing", field=field,
                          fix="the directory needs the model's config.json (save it with save_pretrained)")  # fmt: skip
    try:
        hf = json.loads(f.read_text())
    except (OSError, ValueError) as e:
        raise FtcoreError(f"{f} is not valid JSON: {e}", field=field) from e
    _check_supported(hf, f, field)
    return hf


def _check_supported(hf: dict, f: Path, field: str) -> None:
    archs = hf.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs) and not (
        not archs and hf.get("model_type") == "llama"
    ):
        raise FtcoreError(
            f"{f}: unsupported architecture {archs or hf.get('model_type')!r} (tensor names and "
            f"shapes are mapped for {', '.join(ARCHITECTURES)} only)",
            field=field, fix="use a Llama checkpoint (architectures: [LlamaForCausalLM])",
        )  # fmt: skip
    bad = []
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            bad.append(f"{key}=true")
    rope = rope_scaling(hf)
    if rope is not None and rope.get("rope_type", rope.get("type")) not in ("llama3",):
        bad.append(f"rope_type={rope.get('rope_type', rope.get('type'))}")
    if float(_rope_params(hf).get("partial_rotary_factor", 1.0)) != 1.0:
        bad.append("partial_rotary_factor != 1")
    if bad:
        raise FtcoreError(f"{f}: unsupported Llama variant ({', '.join(bad)})", field=field,
                          fix="ftcore maps plain Llama (SwiGLU, no biases, default or llama3 RoPE)")  # fmt: skip


def _rope_params(hf: dict) -> dict:
    p = hf.get("rope_parameters")
    return p if isinstance(p, dict) else {}


def rope_theta(hf: dict) -> float:
    return float(hf.get("rope_theta", _rope_params(hf).get("rope_theta", 10000.0)))


def rope_scaling(hf: dict) -> dict | None:
    """The llama3 scaling dict, or None for plain RoPE (4.x `rope_scaling` or 5.x `rope_parameters`)."""
    r = hf.get("rope_scaling") or _rope_params(hf)
    if not r or r.get("rope_type", r.get("type", "default")) == "default":
        return None
    return dict(r)


def model_fields(hf: dict, f: str = "config.json") -> dict:
    """The cfg.model keys that config.json determines."""
    try:
        heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        out = {
            "num_layers": int(hf["num_hidden_layers"]),
            "hidden_size": hidden,
            "ffn_hidden_size": int(hf["intermediate_size"]),
            "num_attention_heads": heads,
            "num_query_groups": int(hf.get("num_key_value_heads") or heads),
            "kv_channels": int(hf.get("head_dim") or hidden // heads),
            "vocab_size": int(hf["vocab_size"]),
            "max_position_embeddings": int(hf.get("max_position_embeddings", 4096)),
            "rope_theta": rope_theta(hf),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        }
    except KeyError as e:
        raise FtcoreError(f"{f} has no {e.args[0]!r}", field="model.hf_path") from e
    scaling = rope_scaling(hf)
    if scaling is not None:
        missing = [k for k in ROPE_FIELDS if k not in scaling]
        if missing:
            raise FtcoreError(
                f"{f}: llama3 rope scaling lacks {', '.join(missing)}", field="model.hf_path"
            )
        out["rope_scaling"] = {k: scaling[k] for k in ROPE_FIELDS}
    else:
        out["rope_scaling"] = None
    return out


def merge_hf_config(cfg: DictConfig) -> DictConfig:
    """Fill cfg.model from model.hf_path/config.json; the tokenizer defaults to the same directory."""
    hf = read_hf_config(cfg.model.hf_path)
    fields = model_fields(hf, str(Path(cfg.model.hf_path) / "config.json"))
    from ftcore.config.schema import RopeScalingConfig

    scaling = fields.pop("rope_scaling")
    for key, value in fields.items():
        cfg.model[key] = value
    cfg.model.rope_scaling = None if scaling is None else RopeScalingConfig(**scaling)
    if not cfg.model.get("tokenizer"):
        cfg.model.tokenizer = str(cfg.model.hf_path)
    return cfg


def hf_config_dict(model_cfg, *, dtype: str, tokenizer=None) -> dict:
    """config.json for an exported model: the source's own config (token ids etc.) when there is one,
    with every field ftcore determines written from cfg.model."""
    m = model_cfg
    base: dict = {}
    src = m.get("hf_path")
    if src and (Path(src) / "config.json").is_file():
        try:
            base = json.loads((Path(src) / "config.json").read_text())
        except (OSError, ValueError):
            base = {}
    for key in (
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "transformers_version",
        "torch_dtype",
    ):
        base.pop(key, None)
    if tokenizer is not None:
        if tokenizer.bos_token_id is not None:
            base.setdefault("bos_token_id", tokenizer.bos_token_id)
        if tokenizer.eos_token_id is not None:
            base.setdefault("eos_token_id", tokenizer.eos_token_id)
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    base.update({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": head_dim,
        "vocab_size": m.vocab_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": bool(m.tie_embeddings),
        "rope_theta": float(m.rope_theta),
        "rope_scaling": None if m.rope_scaling is None else
        {"rope_type": "llama3", **{k: m.rope_scaling[k] for k in ROPE_FIELDS}},
        "torch_dtype": dtype,
    })  # fmt: skip
    base.setdefault("initializer_range", m.get("init_std", 0.02))
    base.setdefault("use_cache", True)
    return base
