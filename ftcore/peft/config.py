"""LoRA settings, target names and their checks, kept free of torch and megatron imports so a
config error exits 2 before anything heavy is imported (validate() and the launching parent use
this). The adapter files are read here only as far as the checks need: adapter_config.json and
the tensor shapes in the safetensors header."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path

from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

# Hugging Face names of the slices of each megatron linear, in fused order.
SLICES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "router": ("gate",),  # a MoE layer's router (HF `mlp.gate`); frozen unless targeted
    # multi-head latent attention (DeepSeek-V3): one Hugging Face module each
    "linear_q_proj": ("q_proj",),  # without q_lora_rank
    "linear_q_down_proj": ("q_a_proj",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("kv_b_proj",),
}
COLUMN = ("linear_qkv", "linear_fc1", "linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj")
# MLA's down projections: whole on every TP rank (models/mla.py; TE's "duplicated")
REPLICATED = ("linear_q_down_proj", "linear_kv_down_proj")
MLA_ONLY = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
            "linear_kv_up_proj")  # fmt: skip

# q_proj -> linear_qkv (standard attention); MLA's names -> MLA's linears
HF_NAMES = {s: m for m, slices in SLICES.items() if m not in MLA_ONLY for s in slices}
MLA_HF_NAMES = {**{hf: lin for hf, lin in HF_NAMES.items() if lin != "linear_qkv"},
                **{hf: lin for lin in MLA_ONLY for hf in SLICES[lin]}}  # fmt: skip
HF_ORDER = list(dict.fromkeys([*HF_NAMES, *MLA_HF_NAMES]))  # canonical order of target names
PARENT = {
    "linear_qkv": "self_attention",
    "linear_proj": "self_attention",
    "linear_fc1": "mlp",
    "linear_fc2": "mlp",
    "router": "mlp",
    **dict.fromkeys(MLA_ONLY, "self_attention"),
}
SHARED = "shared_experts."  # a shared expert's slice: "shared_experts.gate_proj" (DeepSeek-V3)
HF_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
             "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp", "gate": "mlp",
             **{s: "self_attn" for m in MLA_ONLY for s in SLICES[m]},
             **{SHARED + s: "mlp" for s in ("gate_proj", "up_proj", "down_proj")}}  # fmt: skip
# a PEFT adapter key: base_model.model.model.layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
PEFT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|block_sparse_moe)\.((?:shared_experts\.)?\w+)"
    r"\.lora_([AB])(?:\.\w+)?\.weight$"
)
ADAPTER_FILE, CONFIG_FILE = "adapter_model.safetensors", "adapter_config.json"
LEGACY_ADAPTER_FILE = "adapter_model.bin"


def scaling(r: int, alpha: float, rslora: bool) -> float:
    return alpha / (r**0.5) if rslora else alpha / r


@dataclass(frozen=True)
class LoraSettings:
    """The adapter's hyper-parameters: the config's, or those of `peft.adapter_path`."""

    r: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    rslora: bool
    adapter_path: str | None = None

    @property
    def scale(self) -> float:
        return scaling(self.r, self.alpha, self.rslora)


@dataclass(frozen=True)
class Geometry:
    """Full (unsharded) shapes of a layer's linears."""

    hidden: int
    ffn: int
    heads: int
    groups: int  # kv heads
    head_dim: int  # standard attention; MLA: the value head (megatron's kv_channels there)
    experts: int = 0  # a mixture of experts: experts per MoE layer (the router's outputs)
    moe_ffn: int = 0  # and each expert's ffn size
    shared_ffn: int = 0  # the shared experts' total width (DeepSeek-V3, GLM-4.5)
    mla: tuple[int, int, int, int, int] | None = None  # q_lora (0: none), kv_lora, nope, rope, v

    @classmethod
    def of(cls, config) -> Geometry:
        """From megatron's TransformerConfig (an MLATransformerConfig for MLA)."""
        mla = None
        if getattr(config, "multi_latent_attention", False):
            mla = (config.q_lora_rank or 0, config.kv_lora_rank, config.qk_head_dim,
                   config.qk_pos_emb_head_dim, config.v_head_dim)  # fmt: skip
        return cls(config.hidden_size, config.ffn_hidden_size, config.num_attention_heads,
                   config.num_query_groups, config.kv_channels, config.num_moe_experts or 0,
                   config.moe_ffn_hidden_size or 0,
                   config.moe_shared_expert_intermediate_size or 0, mla)  # fmt: skip

    def expert(self) -> Geometry:
        """One expert's MLP: the shapes of gate/up/down_proj are those of moe_ffn."""
        return replace(self, ffn=self.moe_ffn)

    def shared(self) -> Geometry:
        """The shared experts' MLP (one MLP of their total width)."""
        return replace(self, ffn=self.shared_ffn)

    def out_in(self, hf_name: str) -> tuple[int, int]:
        """(out, in) features of one slice, full size, as the Hugging Face module has them."""
        if hf_name.startswith(SHARED):
            return self.shared().out_in(hf_name[len(SHARED) :])
        h, f, q, kv = self.hidden, self.ffn, self.heads * self.head_dim, self.groups * self.head_dim
        if self.mla is not None:
            q_lora, kv_lora, nope, rope, v = self.mla
            n = self.heads
            mla = {"q_proj": (n * (nope + rope), h), "q_a_proj": (q_lora, h),
                   "q_b_proj": (n * (nope + rope), q_lora),
                   "kv_a_proj_with_mqa": (kv_lora + rope, h),
                   "kv_b_proj": (n * (nope + v), kv_lora), "o_proj": (h, n * v)}  # fmt: skip
            if hf_name in mla:
                return mla[hf_name]
        return {
            "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f), "gate": (self.experts, h),
        }[hf_name]  # fmt: skip


def geometry(model_cfg) -> Geometry:
    """From the config's `model` section."""
    from ftcore.config.families import family

    m = model_cfg
    mla, head = None, m.kv_channels or m.hidden_size // m.num_attention_heads
    if family(m).mla:
        mla = (int(m.q_lora_rank or 0), int(m.kv_lora_rank), int(m.qk_nope_head_dim),
               int(m.qk_rope_head_dim), int(m.v_head_dim))  # fmt: skip
        head = int(m.v_head_dim)  # as megatron's kv_channels for MLA (models/mla.py)
    return Geometry(m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups,
                    head, getattr(m, "num_experts", None) or 0,
                    getattr(m, "moe_ffn_hidden_size", None) or 0,
                    int(getattr(m, "moe_shared_expert_ffn_hidden_size", None) or 0), mla)  # fmt: skip


def target_names(model_cfg=None) -> tuple[dict[str, str], tuple[str, ...]]:
    """({HF target name: megatron linear}, megatron names) a model's adapters can take: MLA's
    (q_proj only without q_lora_rank, q_a_proj/q_b_proj only with it) or standard attention's."""
    from ftcore.config.families import family

    if model_cfg is None or not family(model_cfg).mla:
        return HF_NAMES, tuple(m for m in SLICES if m not in MLA_ONLY)
    q = (
        ("linear_q_down_proj", "linear_q_up_proj")
        if model_cfg.get("q_lora_rank")
        else ("linear_q_proj",)
    )
    linears = (*q, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj", "linear_fc1",
               "linear_fc2", "router")  # fmt: skip
    return {hf: lin for hf, lin in MLA_HF_NAMES.items() if lin in linears}, linears


def plan_targets(targets, model_cfg=None) -> dict[str, dict[str, str]]:
    """{megatron module: {slice (HF name): A key}}; A key = the slice itself, or the megatron name
    when the slices share one A. `model_cfg` of a latent-attention model takes MLA's names."""
    hf_names, linears = target_names(model_cfg)
    plan: dict[str, dict[str, str]] = {}
    given: dict[str, str] = {}
    for t in targets:
        t = str(t)
        if t in linears:
            shared = t if len(SLICES[t]) > 1 else SLICES[t][0]
            pairs = [(t, s, shared) for s in SLICES[t]]
        elif t in hf_names:
            pairs = [(hf_names[t], t, t)]
        else:
            raise FtcoreError(
                f"unknown target module {t!r}" + (" for this model's attention" if t in HF_ORDER
                                                   or t in SLICES else ""),
                field="peft.target_modules",
                fix=f"use Hugging Face names ({', '.join(hf_names)}) or megatron names ({', '.join(linears)})",
            )  # fmt: skip
        for module, s, key in pairs:
            if s in given and given[s] != t:
                raise FtcoreError(
                    f"{t!r} and {given[s]!r} both put an adapter on {s}",
                    field="peft.target_modules",
                    fix="name each linear once, by its Hugging Face or its megatron name",
                )
            given[s] = t
            plan.setdefault(module, {})[s] = key
    return {m: plan[m] for m in SLICES if m in plan}


def read_adapter_config(path: str) -> dict:
    """adapter_config.json as data: any parse error (a 5,000-digit number too) is exit 2."""
    f = Path(path) / CONFIG_FILE
    if not f.is_file():
        raise FtcoreError(f"{f} does not exist", field="peft.adapter_path",
                          fix="point peft.adapter_path at a PEFT adapter directory (e.g. a run's hf_adapter/)")  # fmt: skip
    return safe_files.read_json_object(f, "peft.adapter_path", root=f.parent)


def adapter_file(path) -> Path:
    """The weights file of a PEFT directory: safetensors, or a legacy .bin."""
    path = Path(path)
    for name in (ADAPTER_FILE, LEGACY_ADAPTER_FILE):
        if (path / name).is_file():
            return path / name
    raise FtcoreError(f"{path} has no {ADAPTER_FILE}", field="peft.adapter_path",
                      fix="point peft.adapter_path at a PEFT adapter directory")  # fmt: skip


def by_module(sd: dict, field: str) -> dict[tuple[int, str, str], object]:
    """{(layer, hf module, A|B): value} of a dict keyed by PEFT keys (tensors or shapes); refuses
    what ftcore cannot load."""
    from ftcore.peft.moe_format import is_expert_key  # the experts' keys: moe_format.by_expert

    out = {}
    for k, t in sd.items():
        if is_expert_key(k):
            continue
        m = PEFT_KEY.search(k)
        if m is None or m.group(3) not in HF_PARENT:
            raise FtcoreError(f"the adapter holds {k}, which ftcore cannot load (only LoRA on "
                              f"{', '.join(HF_PARENT)})", field=field,
                              fix="a LoRA adapter on the attention and MLP projections")  # fmt: skip  # fmt: skip
        out[(int(m.group(1)), m.group(3), m.group(4))] = t
    return out


def adapter_shapes(path) -> dict[str, tuple[int, ...]]:
    """{PEFT key: shape} of an adapter directory, read from the safetensors header."""
    f = adapter_file(path)
    field = "peft.adapter_path"
    if f.name == LEGACY_ADAPTER_FILE:
        sd = safe_files.torch_load(f, field, root=f.parent)  # imports torch: only a legacy .bin
        if not isinstance(sd, dict) or not all(hasattr(t, "shape") for t in sd.values()):
            raise FtcoreError(f"{f} holds no tensors by name", field=field,
                              fix="a PEFT adapter directory")  # fmt: skip
        return {k: tuple(t.shape) for k, t in sd.items()}
    with safe_files.safetensors_open(f, field, root=f.parent, framework="numpy") as st:
        return {k: tuple(st.get_slice(k).get_shape()) for k in st.keys()}


def check_adapter_fits(adapter_dir, model_cfg) -> None:
    """Refuse an adapter whose tensors do not fit the model (another base) before anything is built."""
    from ftcore.peft.moe_format import check_expert_shapes

    config = read_adapter_config(str(adapter_dir))
    geo, r = geometry(model_cfg), int(config["r"])
    shapes = adapter_shapes(adapter_dir)
    check_expert_shapes(adapter_dir, shapes, model_cfg, geo.expert(), r)
    for (layer, mod, ab), shape in by_module(shapes, "peft.adapter_path").items():
        out, inp = geo.out_in(mod)
        want = (r, inp) if ab == "A" else (out, r)
        if layer >= model_cfg.num_layers or shape != want:
            raise FtcoreError(
                f"{adapter_dir}: layers.{layer}.{mod}.lora_{ab} has shape {shape}, this model "
                f"({model_cfg.num_layers} layers) needs {want if layer < model_cfg.num_layers else 'no such layer'}: "
                "the adapter was trained on another base",
                field="peft.adapter_path", fix="use the adapter with the base model it was trained on",
            )  # fmt: skip


def settings(cfg: DictConfig) -> LoraSettings:
    """The effective adapter settings; an adapter_path's adapter_config.json fixes r, alpha, targets
    and rslora."""
    p = cfg.peft
    r, alpha, targets, rslora = p.r, p.lora_alpha, tuple(p.target_modules), p.use_rslora
    if p.adapter_path:
        ac = read_adapter_config(p.adapter_path)
        if str(ac.get("peft_type", "LORA")).upper() != "LORA":
            raise FtcoreError(f"{p.adapter_path} holds a {ac['peft_type']} adapter, not LoRA",
                              field="peft.adapter_path", fix="a LoRA adapter directory")  # fmt: skip
        from ftcore.peft.moe_format import FROM_HF  # Mixtral's w1/w3/w2 are gate/up/down_proj

        tm = [FROM_HF.get(t, t) for t in ac.get("target_modules") or []]
        targets = tuple(sorted(tm, key=HF_ORDER.index) if all(t in HF_ORDER for t in tm) else tm)
        r, alpha, rslora = (
            ac.get("r", r),
            ac.get("lora_alpha", alpha),
            bool(ac.get("use_rslora", False)),
        )
    return LoraSettings(
        int(r), float(alpha), float(p.lora_dropout), targets, bool(rslora), p.adapter_path
    )


def check_config(cfg: DictConfig) -> None:
    """Refuse bad PEFT settings before anything is built (validate() calls this)."""
    p = cfg.peft
    if p.name == "none":
        return
    if p.name == "qlora" and (cfg.precision.fp8_recipe or cfg.precision.fp4_recipe):
        raise FtcoreError(
            f"QLoRA keeps the frozen base in NF4, so it cannot also run {cfg.precision.name}",
            field="precision", fix="use peft=lora with FP8/FP4, or peft=qlora with precision=bf16",
        )  # fmt: skip
    from ftcore.config.families import family

    if p.name == "qlora" and family(cfg.model).qkv_bias:
        raise FtcoreError(
            f"QLoRA's NF4 base linears have no bias; {cfg.model.family} has q/k/v biases",
            field="peft.name", fix="use peft=lora on this model",
        )  # fmt: skip
    from ftcore.peft.moe_format import check_moe_targets, check_no_qlora

    check_no_qlora(cfg)
    s = settings(cfg)
    if s.r <= 0:
        raise FtcoreError(f"rank must be > 0, got {s.r}", field="peft.r", fix="use e.g. peft.r=16")
    if not s.alpha > 0:
        raise FtcoreError(f"lora_alpha must be > 0, got {s.alpha}", field="peft.lora_alpha",
                          fix="peft.lora_alpha=32 (or any number > 0)")  # fmt: skip
    if not 0.0 <= s.dropout < 1.0:
        raise FtcoreError(
            f"lora_dropout must be in [0, 1), got {s.dropout}",
            field="peft.lora_dropout",
            fix="peft.lora_dropout=0.0 (or any value in [0, 1))",
        )
    if not s.targets:
        raise FtcoreError("no target modules", field="peft.target_modules",
                          fix="e.g. peft.target_modules=[q_proj,k_proj,v_proj,o_proj]")  # fmt: skip
    check_moe_targets(cfg, s.targets, plan_targets(s.targets, cfg.model))
    check_nf4_blocks(cfg)
    if s.adapter_path:
        check_adapter_fits(s.adapter_path, cfg.model)


NF4_BLOCK = 64  # values per NF4 block (bitsandbytes' blocksize in models/nf4.py)


def check_nf4_blocks(cfg: DictConfig) -> None:
    """QLoRA at TP > 1 quantises each shard in the blocks one process uses (models/nf4.py); that
    needs every quantised linear's input width (its rows) to be whole blocks, or one process's
    blocks cross rows that TP puts on different ranks."""
    if cfg.peft.name != "qlora" or cfg.parallel.tp == 1:
        return
    m, tp = cfg.model, cfg.parallel.tp
    head_dim = m.kv_channels or m.hidden_size // m.num_attention_heads
    widths = {"q/k/v_proj and gate/up_proj (model.hidden_size)": m.hidden_size,
              "o_proj (heads x head dim)": m.num_attention_heads * head_dim,
              "down_proj (model.ffn_hidden_size)": m.ffn_hidden_size}  # fmt: skip
    for what, width in widths.items():
        if width % NF4_BLOCK:
            raise FtcoreError(
                f"QLoRA at parallel.tp={tp}: the input width of {what} is {width}, not a multiple "
                f"of the {NF4_BLOCK}-value NF4 blocks, so the TP shards cannot quantise as one "
                "process does", field="parallel.tp", fix="parallel.tp=1 for QLoRA on this model, or peft=lora",
            )  # fmt: skip
