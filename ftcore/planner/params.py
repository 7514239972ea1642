"""Which parameters one rank holds: names, element counts, trainable or frozen, linear or not.

Derived from the model shapes and the layout alone (no torch), in megatron's registration order
(embedding, then per layer input norm, out projection, QKV weight and bias, q/k norms, MLP norm,
fc1, fc2, each linear followed by its adapters, then final norm and output layer), so the DDP
buffer layout and its padding can be replayed exactly in `memory.py`. The family's extras
(config/families.py: Qwen2's q/k/v bias, Qwen3's [head_dim] q/k norms) are counted like megatron
allocates them.

A mixture-of-experts layer (model.num_experts set, the layer not in model.moe_dense_layers) has,
after its attention and pre-MLP norm, the router ([experts, hidden], replicated over TP) and this
EP rank's experts (num_experts / ep of them, each an fc1/fc2 pair split over etp, in megatron's
SequentialMLP order); expert parameters (and their adapters) are `expert=True`: megatron keeps
them in buffers of their own, reduced over the expert data-parallel group (memory.py). DeepSeek-V3's
and GLM-4.5's shared experts follow the experts as one dense MLP of their total width, split over
TP (not expert parameters); multi-head latent attention's linears and norms replace q/k/v
(planner/mla.py).
"""

from __future__ import annotations

from typing import NamedTuple

from omegaconf import DictConfig

from ftcore.config.families import family
from ftcore.planner import mla
from ftcore.planner.layers import split_for

# The Hugging Face slices of each megatron linear, in fused order (as ftcore.peft.config.SLICES).
SLICES = {
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
    "linear_q_proj": ("q_proj",),  # multi-head latent attention (planner/mla.py)
    "linear_q_down_proj": ("q_a_proj",),
    "linear_q_up_proj": ("q_b_proj",),
    "linear_kv_down_proj": ("kv_a_proj_with_mqa",),
    "linear_kv_up_proj": ("kv_b_proj",),
}
HF_TO_MEGATRON = {"q_proj": "linear_qkv", "k_proj": "linear_qkv", "v_proj": "linear_qkv",
                  "o_proj": "linear_proj", "gate_proj": "linear_fc1", "up_proj": "linear_fc1",
                  "down_proj": "linear_fc2", "q_a_proj": "linear_q_down_proj",
                  "q_b_proj": "linear_q_up_proj", "kv_a_proj_with_mqa": "linear_kv_down_proj",
                  "kv_b_proj": "linear_kv_up_proj"}  # fmt: skip
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
ROW_PARALLEL = ("linear_proj", "linear_fc2")  # input split over TP; the others split their output


class Param(NamedTuple):
    """One parameter of one rank (a tuple: a 235B MoE rank has ~10^4 of them per layout)."""

    name: str  # stage-local name, e.g. layers.3.linear_fc1 (global layer index)
    numel: int  # elements on this rank
    trainable: bool
    kind: str  # embedding | norm | linear | bias | output | lora | router
    layer: int = -1  # global transformer layer index (-1 outside the layers)
    expert: bool = False  # an expert's weight or adapter (EP-sharded, its own DDP buffer)


def padded_vocab(vocab_size: int, tp: int, multiple: int = 128) -> int:
    """megatron pads the vocab to a multiple of 128*tp (same rule as ftcore.models.llama)."""
    m = multiple * tp
    return -(-vocab_size // m) * m


def lora_plan(cfg: DictConfig) -> dict[str, dict[str, str]]:
    """{megatron linear: {slice: A key}} as ftcore.peft.config.plan_targets builds it: a megatron
    name gives every slice one shared A, a Hugging Face name one slice with its own A."""
    if cfg.peft.name not in ("lora", "qlora"):
        return {}
    plan: dict[str, dict[str, str]] = {}
    mla_q = "linear_q_proj" if mla.is_mla(cfg.model) else "linear_qkv"  # MLA's q_proj: one linear
    for t in map(str, cfg.peft.target_modules):
        if t in SLICES:
            shared = t if len(SLICES[t]) > 1 else SLICES[t][0]
            pairs = [(t, s, shared) for s in SLICES[t]]
        else:
            pairs = [(mla_q if t == "q_proj" else HF_TO_MEGATRON.get(t, t), t, t)]
        for module, s, key in pairs:
            plan.setdefault(module, {})[s] = key
    return {m: plan[m] for m in SLICES if m in plan}


def lora_targets(cfg: DictConfig) -> list[str]:
    """Megatron linears that carry an adapter."""
    return list(lora_plan(cfg))


def linear_shapes(m: DictConfig, tp: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each layer linear on one TP rank (MLA's in place of q/k/v: planner/mla.py)."""
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    q, kv, h, f = (
        m.num_attention_heads * d,
        m.num_query_groups * d,
        m.hidden_size,
        m.ffn_hidden_size,
    )
    attention = {"linear_qkv": ((q + 2 * kv) // tp, h), "linear_proj": (h, q // tp)}
    if mla.is_mla(m):
        attention = mla.attention_linears(m, tp)
    return {**attention, "linear_fc1": (2 * f // tp, h), "linear_fc2": (h, f // tp)}


def shared_shapes(m, tp: int) -> dict[str, tuple[int, int]]:
    """(out, in) of the shared experts' fc1 and fc2 on one TP rank ({} without shared experts)."""
    f = int(getattr(m, "moe_shared_expert_ffn_hidden_size", None) or 0)
    return (
        {"linear_fc1": (2 * f // tp, m.hidden_size), "linear_fc2": (m.hidden_size, f // tp)}
        if f
        else {}
    )


def is_moe(m) -> bool:
    return bool(getattr(m, "num_experts", None))


def moe_layer(m, layer: int) -> bool:
    """Whether global layer `layer` has routed experts (else a dense MLP of ffn_hidden_size)."""
    return is_moe(m) and layer not in (getattr(m, "moe_dense_layers", None) or ())


def moe_layer_count(m) -> int:
    if not is_moe(m):
        return 0
    return m.num_layers - len(
        set(getattr(m, "moe_dense_layers", None) or ()) & set(range(m.num_layers))
    )


def expert_shapes(m, etp: int) -> dict[str, tuple[int, int]]:
    """(out, in) of one expert's fc1 (gate and up) and fc2 on one expert-TP rank."""
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    return {"linear_fc1": (2 * f // etp, m.hidden_size), "linear_fc2": (m.hidden_size, f // etp)}


def slice_out_in(m: DictConfig, name: str, ffn: int | None = None) -> tuple[int, int]:
    """Full (out, in) of one Hugging Face slice (`ffn`: an expert's width instead of the MLP's)."""
    if mla.is_mla(m) and mla.slice_out_in(m, name) is not None:
        return mla.slice_out_in(m, name)
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    h, f = m.hidden_size, ffn or m.ffn_hidden_size
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f),
    }[name]  # fmt: skip


def lora_params(
    m: DictConfig, module: str, slices: dict[str, str], r: int, tp: int, ffn: int | None = None
) -> list[tuple[str, int]]:
    """(name, elements on one TP rank) of a linear's adapters, A's then B's as registered.
    Column-parallel base: A (r x in) replicated, B (slice_out/tp x r). Row-parallel base:
    A (r x in/tp), B (out x r) replicated. MLA's down projections: both whole."""
    column = module not in ROW_PARALLEL
    whole = module in mla.REPLICATED
    a_out, b_out = [], []
    for s, key in slices.items():
        out, inp = slice_out_in(m, s, ffn)
        if key not in [k for k, _ in a_out]:
            a_out.append((key, r * (inp if column else inp // tp)))
        b_out.append((s, (out // tp if column and not whole else out) * r))
    return [(f"lora_A.{k}", n) for k, n in a_out] + [(f"lora_B.{k}", n) for k, n in b_out]


def layer_params(cfg: DictConfig, layer: int, tp: int) -> list[Param]:
    return _renamed(_layer_template(cfg, tp, moe_layer(cfg.model, layer)), layer)


def _expert_template(cfg: DictConfig) -> list[tuple[str, int, bool, str, bool]]:
    """The router and this EP rank's experts with their adapters (megatron's MoELayer order)."""
    m, p = cfg.model, cfg.parallel
    full = cfg.peft.name == "none"
    etp = getattr(p, "etp", 1) or 1
    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    plan = lora_plan(cfg)
    out = [("mlp.router.weight", m.num_experts * m.hidden_size, full, "router", False)]
    for e in range(m.num_experts // (getattr(p, "ep", 1) or 1)):
        for name, (o, i) in expert_shapes(m, etp).items():
            pre = f"mlp.experts.local_experts.{e}.{name}"
            out.append((pre, o * i, full, "linear", True))
            for pname, n in lora_params(m, name, plan.get(name, {}), cfg.peft.r, etp, f):
                out.append((f"{pre}.{pname}", n, True, "lora", True))
    sf = getattr(m, "moe_shared_expert_ffn_hidden_size", None)
    for name, (o, i) in shared_shapes(m, p.tp).items():  # a dense MLP of their width, over TP
        out.append((f"mlp.shared_experts.{name}", o * i, full, "linear", False))
        for pname, n in lora_params(m, name, plan.get(name, {}), cfg.peft.r, p.tp, sf):
            out.append((f"mlp.shared_experts.{name}.{pname}", n, True, "lora", False))
    return out


def _layer_template(
    cfg: DictConfig, tp: int, moe: bool = False
) -> list[tuple[str, int, bool, str, bool]]:
    """(suffix, elements, trainable, kind, expert) of one layer's parameters in registration
    order."""
    m = cfg.model
    h = m.hidden_size
    full = cfg.peft.name == "none"
    plan = lora_plan(cfg)
    shapes = linear_shapes(m, tp)
    fam = family(m)
    d = m.kv_channels or m.hidden_size // m.num_attention_heads
    out = [("input_layernorm", h, full, "norm", False)]
    for name in shapes:  # the attention's linears (linear_proj first), then fc1 and fc2
        if name == "linear_fc1":
            if mla.is_mla(m):  # the q and kv latents' norms, replicated
                out.append(("latent_layernorms", mla.latent_norms(m), full, "norm", False))
            elif fam.qk_layernorm:  # replicated over TP: one [head_dim] weight each
                out += [
                    ("q_layernorm", d, full, "norm", False),
                    ("k_layernorm", d, full, "norm", False),
                ]
            out.append(("pre_mlp_layernorm", h, full, "norm", False))
            if moe:
                return out + _expert_template(cfg)
        o, i = shapes[name]
        out.append((name, o * i, full, "linear", False))
        if name == "linear_qkv" and fam.qkv_bias:  # sharded like the weight's rows
            out.append(("linear_qkv.bias", o, full, "bias", False))
        for pname, n in lora_params(m, name, plan.get(name, {}), cfg.peft.r, tp):
            out.append((f"{name}.{pname}", n, True, "lora", False))
    return out


def _renamed(template, layer: int) -> list[Param]:
    pre = f"layers.{layer}."
    return [Param(pre + n, k, t, kind, layer, ex) for n, k, t, kind, ex in template]


def chunk_params(cfg: DictConfig, pp_rank: int, vp_stage: int) -> list[Param]:
    """Parameters of one model chunk (one GPTModel) of one rank, in registration order."""
    m, p = cfg.model, cfg.parallel
    tp, pp, vp = p.tp, p.pp, p.vp
    split = split_for(cfg)
    full = cfg.peft.name == "none"
    v = padded_vocab(m.vocab_size, tp) // tp * m.hidden_size
    first = pp_rank == 0 and vp_stage == 0
    last = pp_rank == pp - 1 and vp_stage == vp - 1
    out: list[Param] = []
    if first:
        out.append(Param("embedding", v, full, "embedding"))
    start = split.offsets[pp_rank][vp_stage]
    templates = {moe: _layer_template(cfg, tp, moe) for moe in {False, is_moe(m)}}
    for layer in range(start, start + split[pp_rank][vp_stage]):
        out += _renamed(templates[moe_layer(m, layer)], layer)
    if last:
        out.append(Param("final_layernorm", m.hidden_size, full, "norm"))
        if not m.tie_embeddings or pp > 1:
            out.append(Param("output_layer", v, full, "output"))
    return out


class Run(NamedTuple):
    """`count` consecutive parameters or layers of one kind in a model chunk: the embedding, the
    final norm, the output layer, or layers ("layer", moe) whose linears are quantized or not."""

    what: str | tuple[str, bool]
    count: int
    quantized: bool = False


def chunk_runs(cfg: DictConfig, pp_rank: int, vp_stage: int) -> tuple[Run, ...]:
    """chunk_params as runs (in registration order): cheap to compute and to compare, so memory
    can reuse one chunk's bytes for every chunk made of the same runs (buffers.py)."""
    m, p = cfg.model, cfg.parallel
    split = split_for(cfg)
    keep = cfg.precision.first_last_bf16_layers
    kind = lambda i: (moe_layer(m, i), keep <= i < m.num_layers - keep)  # noqa: E731
    out: list[Run] = []
    if pp_rank == 0 and vp_stage == 0:
        out.append(Run("embedding", 1))
    start = split.offsets[pp_rank][vp_stage]
    end = start + split[pp_rank][vp_stage]
    layer = start
    while layer < end:
        n = 1
        while layer + n < end and kind(layer + n) == kind(layer):
            n += 1
        moe, quantized = kind(layer)
        out.append(Run(("layer", moe), n, quantized))
        layer += n
    if pp_rank == p.pp - 1 and vp_stage == p.vp - 1:
        out.append(Run("final_layernorm", 1))
        if not m.tie_embeddings or p.pp > 1:
            out.append(Run("output_layer", 1))
    return tuple(out)


def run_params(cfg: DictConfig, run: Run) -> list[tuple[str, int, bool, str, bool]]:
    """(name, elements, trainable, kind, expert) of one copy of a run, in registration order."""
    m, p = cfg.model, cfg.parallel
    full = cfg.peft.name == "none"
    if isinstance(run.what, tuple):
        return _layer_template(cfg, p.tp, run.what[1])
    if run.what == "final_layernorm":
        return [("final_layernorm", m.hidden_size, full, "norm", False)]
    v = padded_vocab(m.vocab_size, p.tp) // p.tp * m.hidden_size
    kind = "embedding" if run.what == "embedding" else "output"
    return [(run.what, v, full, kind, False)]


def rank_params(cfg: DictConfig, pp_rank: int) -> list[list[Param]]:
    """Per model chunk (virtual stage) of this pipeline rank."""
    return [chunk_params(cfg, pp_rank, v) for v in range(cfg.parallel.vp)]


def total_params(cfg: DictConfig) -> int:
    """All parameters of the unsharded model (base + adapters, every expert), counted once."""
    return _count(cfg, active=False)


def active_params(cfg: DictConfig) -> int:
    """Parameters one token passes through: the router and its top-k experts in each MoE layer
    (equal to total_params for a dense model)."""
    return _count(cfg, active=True)


def _count(cfg: DictConfig, active: bool) -> int:
    m = cfg.model
    h = m.hidden_size
    attn, dense_mlp, moe_mlp = _layer_counts(cfg, active)
    n_moe = moe_layer_count(m)
    total = m.num_layers * attn + (m.num_layers - n_moe) * dense_mlp + n_moe * moe_mlp
    emb = m.vocab_size * h
    return total + emb * (1 if m.tie_embeddings else 2) + h


def _layer_counts(cfg: DictConfig, active: bool) -> tuple[int, int, int]:
    """Unsharded elements of one layer's attention side (its norm included), of a dense MLP side
    and of a MoE MLP side (pre-MLP norm, router, every or the top-k experts, the shared experts,
    the expert bias), adapters included."""
    m = cfg.model
    h = m.hidden_size
    base = linear_shapes(m, 1)
    fam = family(m)
    d = m.kv_channels or h // m.num_attention_heads
    mlp_keys = ("linear_fc1", "linear_fc2")
    attn = h + sum(o * i for k, (o, i) in base.items() if k not in mlp_keys)
    if mla.is_mla(m):
        attn += mla.latent_norms(m)
    else:
        attn += base["linear_qkv"][0] if fam.qkv_bias else 0
        attn += 2 * d if fam.qk_layernorm else 0
    plan = lora_plan(cfg)
    lora = {t: sum(n for _, n in lora_params(m, t, sl, cfg.peft.r, 1)) for t, sl in plan.items()}
    attn += sum(n for t, n in lora.items() if t not in mlp_keys)
    dense_mlp = h + sum(o * i for t, (o, i) in base.items() if t in mlp_keys)
    dense_mlp += sum(n for t, n in lora.items() if t in mlp_keys)
    if not is_moe(m):
        return attn, dense_mlp, 0

    def mlp_lora(ffn) -> int:
        return sum(n for t, sl in plan.items() if t in mlp_keys
                   for _, n in lora_params(m, t, sl, cfg.peft.r, 1, ffn))  # fmt: skip

    f = m.moe_ffn_hidden_size or m.ffn_hidden_size
    expert = sum(o * i for o, i in expert_shapes(m, 1).values()) + mlp_lora(f)
    experts = m.moe_router_topk if active else m.num_experts
    moe_mlp = h + m.num_experts * h + experts * expert
    sf = getattr(m, "moe_shared_expert_ffn_hidden_size", None)
    if sf:  # the shared experts (their adapters: the MLP's targets), always active
        moe_mlp += sum(o * i for o, i in shared_shapes(m, 1).values()) + mlp_lora(sf)
    moe_mlp += (
        m.num_experts if getattr(m, "moe_router_expert_bias", None) else 0
    )  # a buffer, in the file
    return attn, dense_mlp, moe_mlp


def mtp_params(cfg: DictConfig) -> int:
    """The multi-token-prediction layers a checkpoint carries (model.mtp_layers; not built, not
    trained, copied into the export: hf/carried.py), as DeepSeek-V3 publishes them: a layer like
    the last (MoE), the projection of [embedding; hidden] (2h x h), three norms, and its own
    copies of the embedding and the head."""
    m = cfg.model
    n = int(getattr(m, "mtp_layers", None) or 0)
    attn, dense_mlp, moe_mlp = _layer_counts(cfg, active=False)
    layer = attn + (moe_mlp if is_moe(m) else dense_mlp)
    h = m.hidden_size
    return n * (layer + 2 * h * h + 3 * h + 2 * m.vocab_size * h)


# model.init_method=auto draws each rank's shard on its GPU from this model size on (base + adapters,
# unsharded). The layout-independent draw runs on the CPU at ~2.2 s per 1e8 normal values on one
# thread (measured on a CI VM): 8B ~3 min per rank, 405B ~2.5 h; below 1e9 it is seconds.
# ftcore.models.init draws either way.
INIT_SHARDED_ABOVE = 1_000_000_000


def init_method(cfg: DictConfig, *, on_gpu: bool) -> str:
    """`model.init_method` resolved: `auto` is `sharded` on GPU from INIT_SHARDED_ABOVE parameters
    on, `layout_independent` otherwise (tests, small models, every CPU run)."""
    method = cfg.model.init_method
    if method != "auto":
        return method
    return "sharded" if on_gpu and total_params(cfg) >= INIT_SHARDED_ABOVE else "layout_independent"
