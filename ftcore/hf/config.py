"""Hugging Face `config.json` <-> the `model` config section.

Reading fills cfg.model from a local HF directory (family, shapes, GQA, head dim, vocab, rope theta
and all four llama3 rope_scaling fields, rms eps, tied embeddings; DeepSeek-V3's latent attention
with its YaRN scaling and GLM-4.5's partial rotary, biases and q/k norms: docs/deepseek.md) and
refuses what ftcore cannot represent exactly (other architectures, MoE routing megatron computes
otherwise: ftcore/hf/moe_config.py, other activations or rope types, sliding-window attention that
is on for the training length). The families are ftcore/config/families.py. Both the
transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are read;
export writes the 4.x spelling, which every version reads.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ftcore.config.families import BY_ARCHITECTURE, BY_MODEL_TYPE, FAMILIES, Family
from ftcore.errors import FtcoreError
from ftcore.hf import fp8
from ftcore.hf.moe_config import check_moe_keys, moe_export_keys, moe_fields
from ftcore.hf.moe_config import value as hf_value
from ftcore.runtime import safe_files

ARCHITECTURES = tuple(BY_ARCHITECTURE)
ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
YARN_FIELDS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim")  # fmt: skip
MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def hf_dir(path: str, field: str = "model.hf_path") -> Path:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise FtcoreError(f"{p} is not a directory", field=field,
                          fix="point it at a local Hugging Face model directory (config.json + *.safetensors)")  # fmt: skip
    return p


def read_hf_config(path: str, field: str = "model.hf_path", seq_len: int | None = None) -> dict:
    """config.json of an HF directory, checked to be a model ftcore can load exactly (at sequences
    of seq_len tokens: a sliding window at least that long changes nothing)."""
    f = hf_dir(path, field) / "config.json"
    if not f.is_file():
        raise FtcoreError(f"{f} is missing", field=field,
                          fix="the directory needs the model's config.json (save it with save_pretrained)")  # fmt: skip
    hf = safe_files.read_json_object(f, field, root=f.parent)
    _check_supported(hf, f, field)
    check_sliding_window(hf, f, seq_len)
    return hf


def hf_family(hf: dict) -> Family | None:
    """The family of a config.json: its `architectures`, else its `model_type`."""
    for a in hf.get("architectures") or []:
        if a in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[a]
    if not hf.get("architectures"):
        return BY_MODEL_TYPE.get(hf.get("model_type"))
    return None


def _check_supported(hf: dict, f: Path, field: str) -> None:
    archs = hf.get("architectures") or []
    fam = hf_family(hf)
    check_moe_keys(hf, f, field, fam.name if fam else None)
    if fam is None:
        raise FtcoreError(
            f"{f}: unsupported architecture {archs or hf.get('model_type')!r}; tensor names "
            f"and shapes are mapped for {', '.join(ARCHITECTURES)} only",
            field=field, fix="use a dense checkpoint of one of those architectures",
        )  # fmt: skip
    fp8.block_of(hf, str(f))  # another quantization is refused naming its key
    bad = []
    if hf.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={hf['hidden_act']}")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key) and not (key == "attention_bias" and fam.name == "glm4_moe"):
            bad.append(f"{key}=true")  # GLM-4.5's: q/k/v biases, as megatron's add_qkv_bias
    rope = rope_scaling(hf)
    kind = None if rope is None else rope.get("rope_type", rope.get("type"))
    if kind is not None and kind != ("yarn" if fam.mla else "llama3"):
        bad.append(f"rope_type={kind}")  # YaRN: megatron's MLA only; llama3: ftcore's rope.py
    if kind == "yarn":
        bad += _yarn_refused(rope)
    if partial_rotary(hf, fam.name) != 1.0 and fam.name != "glm4_moe":
        bad.append("partial_rotary_factor != 1")
    if fam.mla and not hf_value(hf, fam.name, "rope_interleave"):
        bad.append("rope_interleave=false (megatron's MLA rotates interleaved pairs)")
    if bad:
        raise FtcoreError(f"{f}: unsupported {fam.architecture} variant ({', '.join(bad)})", field=field,
                          fix="ftcore maps SwiGLU, the family's own biases, default or llama3 RoPE")  # fmt: skip


def _yarn_refused(rope: dict) -> list[str]:
    """What of a YaRN dict megatron's YarnRotaryEmbedding computes otherwise than transformers."""
    bad = [f"rope_scaling.{k}" for k in ("attention_factor",) if rope.get(k) is not None]
    if rope.get("truncate", True) is False:
        bad.append("rope_scaling.truncate=false")
    if rope.get("mscale_all_dim") and not rope.get("mscale"):
        bad.append("rope_scaling.mscale_all_dim without mscale")
    if rope.get("factor") is None or rope.get("original_max_position_embeddings") is None:
        bad.append("rope_scaling without factor and original_max_position_embeddings")
    return bad


def partial_rotary(hf: dict, family: str | None = None) -> float:
    """The share of the head dim RoPE rotates (GLM-4.5: 0.5; top level or in rope_parameters)."""
    v = _rope_params(hf).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if v is None:
        v = hf_value(hf, family, "partial_rotary_factor")
    return float(1.0 if v is None else v)


def check_sliding_window(hf: dict, f: Path | str, seq_len: int | None) -> None:
    """Refuse sliding-window attention where config.json turns it on for some layer and the window
    is shorter than the sequence (HF masks keys `window` or more tokens back, so a window >=
    seq_len masks nothing). Judged by the switches, not the key: `layer_types` (transformers 5)
    when present, else Qwen2/3's `use_sliding_window` (from layer `max_window_layers` on, as
    transformers 4 applied it), else (Mistral, no switch) whether `sliding_window` is set. Qwen
    configs carry `sliding_window` with `use_sliding_window: false`."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types") or []
    if types:
        on = any(t != "full_attention" for t in types)
    elif "use_sliding_window" in hf:
        first = hf.get("max_window_layers")
        layers = hf.get("num_hidden_layers")
        on = bool(hf["use_sliding_window"]) and (first is None or layers is None or first < layers)
    else:
        on = window is not None
    if not on:
        return
    if window is not None and seq_len is not None and int(window) >= seq_len:
        return
    at = f"data.seq_len={seq_len}" if seq_len is not None else "the sequence length"
    raise FtcoreError(
        f"{f}: sliding-window attention (window {window}) is on and shorter than {at}; ftcore "
        "attends over the whole sequence, which would not be this model",
        field="data.seq_len" if window is not None else "model.hf_path",
        fix=f"use data.seq_len <= {window}" if window is not None else "use a full-attention model",
    )  # fmt: skip


def _rope_params(hf: dict) -> dict:
    p = hf.get("rope_parameters")
    return p if isinstance(p, dict) else {}


def rope_theta(hf: dict) -> float:
    return float(hf.get("rope_theta", _rope_params(hf).get("rope_theta", 10000.0)))


def rope_scaling(hf: dict) -> dict | None:
    """The llama3/yarn scaling dict, or None for plain RoPE (4.x `rope_scaling` or 5.x
    `rope_parameters`)."""
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
            "family": (hf_family(hf) or FAMILIES["llama"]).name,
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
        raise FtcoreError(
            f"{f} has no {e.args[0]!r}",
            field="model.hf_path",
            fix="restore config.json from the model's original files",
        ) from e  # fmt: skip
    out.update(moe_fields(hf, out["family"], out["num_layers"]))
    out.update(_attention_fields(hf, out["family"]))
    out["rope_scaling"] = _scaling_fields(rope_scaling(hf), f)
    out["fp8_block"] = fp8.block_of(hf, f)  # FP8 weights with block scales (hf/fp8.py)
    return out


def _attention_fields(hf: dict, family: str) -> dict:
    """MLA's shapes (DeepSeek-V3), GLM-4.5's partial rotary, biases and q/k norms, and the count of
    multi-token-prediction layers (carried into the export, not built)."""
    out: dict = {"rotary_percent": partial_rotary(hf, family),
                 "mtp_layers": int(hf.get("num_nextn_predict_layers") or 0),
                 "qkv_bias": None, "qk_layernorm": None, **dict.fromkeys(MLA_FIELDS)}  # fmt: skip
    if FAMILIES[family].mla:
        mla = {k: hf_value(hf, family, k) for k in MLA_FIELDS}
        out.update({k: None if v is None else int(v) for k, v in mla.items()})
        out["kv_channels"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]  # q and k heads
        out["num_query_groups"] = int(hf["num_attention_heads"])  # MLA: one k/v per head
    if family == "glm4_moe":
        out["qkv_bias"] = bool(hf_value(hf, family, "attention_bias"))
        out["qk_layernorm"] = bool(hf_value(hf, family, "use_qk_norm"))
    return out


def _scaling_fields(scaling: dict | None, f: str) -> dict | None:
    """model.rope_scaling from config.json's llama3 or yarn dict (yarn: transformers' concentration
    mscale(f, mscale) / mscale(f, mscale_all_dim) when both are set, else mscale(f, 1), which
    megatron computes from mscale 1 and mscale_all_dim 0)."""
    if scaling is None:
        return None
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        both = bool(scaling.get("mscale")) and bool(scaling.get("mscale_all_dim"))
        return {"rope_type": "yarn", "factor": float(scaling["factor"]),
                "original_max_position_embeddings": int(scaling["original_max_position_embeddings"]),
                "beta_fast": float(scaling.get("beta_fast") or 32),
                "beta_slow": float(scaling.get("beta_slow") or 1),
                "mscale": float(scaling["mscale"]) if both else 1.0,
                "mscale_all_dim": float(scaling["mscale_all_dim"]) if both else 0.0}  # fmt: skip
    missing = [k for k in ROPE_FIELDS if k not in scaling]
    if missing:
        raise FtcoreError(
            f"{f}: llama3 rope scaling lacks {', '.join(missing)}",
            field="model.hf_path",
            fix="restore config.json's rope_scaling from the model's original files",
        )
    return {k: scaling[k] for k in ROPE_FIELDS}


def merge_hf_config(cfg: DictConfig) -> DictConfig:
    """Fill cfg.model from model.hf_path/config.json; the tokenizer defaults to the same directory."""
    hf = read_hf_config(cfg.model.hf_path, seq_len=cfg.data.seq_len)
    fields = model_fields(hf, str(Path(cfg.model.hf_path) / "config.json"))
    from ftcore.config.groups import RopeScalingConfig

    scaling = fields.pop("rope_scaling")
    for key, value in fields.items():
        cfg.model[key] = value
    cfg.model.rope_scaling = None if scaling is None else RopeScalingConfig(**scaling)
    if not cfg.model.get("tokenizer"):
        cfg.model.tokenizer = str(cfg.model.hf_path)
    return cfg


def _scaling_export(r) -> dict | None:
    if r is None:
        return None
    if r.get("rope_type", "llama3") == "yarn":
        return {"rope_type": "yarn", **{k: r[k] for k in YARN_FIELDS}}
    return {"rope_type": "llama3", **{k: r[k] for k in ROPE_FIELDS}}


def _attention_export(m) -> dict:
    """config.json keys of MLA (DeepSeek-V3) and GLM-4.5's attention, as published."""
    from ftcore.config.families import family

    f = family(m)
    out: dict = {}
    if f.name in ("deepseek_v3", "glm4_moe"):
        out["num_nextn_predict_layers"] = int(m.get("mtp_layers") or 0)
    if f.mla:
        out.update({k: (None if m[k] is None else int(m[k])) for k in MLA_FIELDS})
        # transformers' DeepseekV3Config writes head_dim = qk_rope_head_dim (the rotary width)
        out.update({"head_dim": int(m.qk_rope_head_dim), "rope_interleave": True,
                    "attention_bias": False, "num_key_value_heads": m.num_attention_heads})  # fmt: skip
    if f.name == "glm4_moe":
        out.update({"attention_bias": bool(f.qkv_bias), "use_qk_norm": bool(f.qk_layernorm),
                    "partial_rotary_factor": float(m.get("rotary_percent") or 1.0)})  # fmt: skip
    return out


def hf_config_dict(model_cfg, *, dtype: str, tokenizer=None) -> dict:
    """config.json for an exported model: the source's own config (token ids etc.) when there is one,
    with every field ftcore determines written from cfg.model."""
    m = model_cfg
    base: dict = {}
    src = m.get("hf_path")
    if src and (Path(src) / "config.json").is_file():
        try:
            base = safe_files.read_json_object(
                Path(src) / "config.json", "model.hf_path", root=Path(src)
            )
        except FtcoreError:
            base = {}
    for key in (
        "quantization_config",  # written for an FP8 export only (hf_config_dict's caller)
        "num_experts",  # MoE: moe_export_keys writes the published spelling
        "num_local_experts",
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
    fam = FAMILIES[m.get("family") or "llama"]
    if hf_family(base) is not fam:  # a source of another family: none of its keys apply
        base = {k: base[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in base}
    base.update({
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        "hidden_act": "silu",
        **fam.export_keys,
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
        "rope_scaling": _scaling_export(m.rope_scaling),
        "torch_dtype": dtype,
        **moe_export_keys(m),
        **_attention_export(m),
    })  # fmt: skip
    if fam.name == "mixtral" and m.get("num_experts"):  # one size for every expert, no dense MLP
        base["intermediate_size"] = m.moe_ffn_hidden_size
    base.setdefault("initializer_range", m.get("init_std", 0.02))
    base.setdefault("use_cache", True)
    return base
