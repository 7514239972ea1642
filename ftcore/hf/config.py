"""Hugging Face `config.json` <-> the `model` config section.

Reading fills cfg.model from a local HF directory (family, shapes, GQA, head dim, vocab, rope theta
and all four llama3 rope_scaling fields, rms eps, tied embeddings) and refuses what ftcore cannot
represent exactly (other architectures, MoE routing other than Qwen3-MoE's and Mixtral's:
ftcore/hf/moe_config.py, other activations or rope types, sliding-window
attention that is on for the training length). The families are ftcore/config/families.py. Both the
transformers 4.x (`rope_theta` + `rope_scaling`) and 5.x (`rope_parameters`) spellings are read;
export writes the 4.x spelling, which every version reads.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from ftcore.config.families import BY_ARCHITECTURE, BY_MODEL_TYPE, FAMILIES, Family
from ftcore.errors import FtcoreError
from ftcore.hf.moe_config import check_moe_keys, moe_export_keys, moe_fields
from ftcore.runtime import safe_files

ARCHITECTURES = tuple(BY_ARCHITECTURE)
ROPE_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


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
        raise FtcoreError(f"{f}: unsupported {fam.architecture} variant ({', '.join(bad)})", field=field,
                          fix="ftcore maps SwiGLU, the family's own biases, default or llama3 RoPE")  # fmt: skip


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
    scaling = rope_scaling(hf)
    if scaling is not None:
        missing = [k for k in ROPE_FIELDS if k not in scaling]
        if missing:
            raise FtcoreError(
                f"{f}: llama3 rope scaling lacks {', '.join(missing)}",
                field="model.hf_path",
                fix="restore config.json's rope_scaling from the model's original files",
            )
        out["rope_scaling"] = {k: scaling[k] for k in ROPE_FIELDS}
    else:
        out["rope_scaling"] = None
    return out


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
        "rope_scaling": None if m.rope_scaling is None else
        {"rope_type": "llama3", **{k: m.rope_scaling[k] for k in ROPE_FIELDS}},
        "torch_dtype": dtype,
        **moe_export_keys(m),
    })  # fmt: skip
    if fam.name == "mixtral" and m.get("num_experts"):  # one size for every expert, no dense MLP
        base["intermediate_size"] = m.moe_ffn_hidden_size
    base.setdefault("initializer_range", m.get("init_std", 0.02))
    base.setdefault("use_cache", True)
    return base
