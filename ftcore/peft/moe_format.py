"""PEFT's names for LoRA on a mixture of experts, kept free of torch (the config checks read them).

ftcore writes the per-expert layout of the published checkpoints (docs/moe.md, "LoRA on the
experts"): `...layers.<i>.mlp.experts.<k>.<gate_proj|up_proj|down_proj>.lora_<A|B>.weight`
(Mixtral: `block_sparse_moe.experts.<k>.<w1|w3|w2>`), each expert its own A [r, in] and
B [out, r], and the router as `...layers.<i>.<mlp|block_sparse_moe>.gate.lora_<A|B>.weight`.
PEFT 0.21.2 converts that layout itself when it loads it onto transformers 5's fused experts
(gate and up concatenated along r, block-diagonal B, r and alpha doubled for gate_up_proj), so
the same files load on transformers 4 and 5. Ours: `decoder.layers.<i>.mlp.experts.
local_experts.<k>.<linear_fc1|linear_fc2>.lora_<A|B>.<key>` with k the global expert index.
"""

from __future__ import annotations

import re

from ftcore.errors import FtcoreError

EXPERT_SLICES = ("gate_proj", "up_proj", "down_proj")
EXPERT_LINEAR = {"gate_proj": "linear_fc1", "up_proj": "linear_fc1", "down_proj": "linear_fc2"}
# the module names of each family's published per-expert checkpoint (Mixtral: w1 gate, w3 up, w2 down)
_PLAIN = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"}
HF_EXPERT_NAME = {
    "qwen3_moe": _PLAIN,
    "mixtral": {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"},
    "deepseek_v3": _PLAIN,  # transformers converts these as Qwen3-MoE's (qwen2_moe pattern)
    "glm4_moe": _PLAIN,
}
MOE_BLOCK = {"qwen3_moe": "mlp", "mixtral": "block_sparse_moe", "deepseek_v3": "mlp",
             "glm4_moe": "mlp"}  # fmt: skip
FROM_HF = {hf: s for names in HF_EXPERT_NAME.values() for s, hf in names.items()}

OUR_EXPERT_KEY = re.compile(
    r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.lora_([AB])\.(\w+)$"
)
PEFT_EXPERT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)
# what PEFT itself writes for transformers 5's fused experts (target_parameters, ParamWrapper)
PEFT_FUSED_KEY = re.compile(r"\.experts\.(?:base_layer\.)*lora_[AB]")


def is_moe(model_cfg) -> bool:
    return bool(getattr(model_cfg, "num_experts", None))


def hf_expert_key(family: str, layer: int, expert: int, s: str, ab: str) -> str:
    name = HF_EXPERT_NAME[family][s]
    return f"base_model.model.model.layers.{layer}.{MOE_BLOCK[family]}.experts.{expert}.{name}.lora_{ab}.weight"


def hf_router_key(family: str, layer: int, ab: str) -> str:
    return f"base_model.model.model.layers.{layer}.{MOE_BLOCK[family]}.gate.lora_{ab}.weight"


def peft_targets(
    family: str, targets: list[str], dense_layers, shared: bool = False
) -> tuple[list[str], list[str] | None]:
    """(target_modules, target_parameters) of adapter_config.json for a MoE model.

    The expert slices take the family's names (Mixtral: w1/w3/w2). PEFT on transformers 5 turns
    every target named gate_proj/up_proj/down_proj into its fused experts' parameters, so the
    dense MLPs of a Qwen3-MoE (mlp_only_layers) and DeepSeek-V3's shared experts (plain linears
    under the same names) would silently lose their adapters: naming their weights in
    target_parameters keeps them (checked against PEFT 0.21.2 in the tests)."""
    names = HF_EXPERT_NAME.get(family, {})
    modules = [names.get(t, t) for t in targets]
    params = [f"mlp.{t}.weight" for t in targets if t in EXPERT_SLICES and dense_layers]
    params += [f"shared_experts.{t}.weight" for t in targets if t in EXPERT_SLICES and shared]
    return modules, params or None


def by_expert(sd: dict, field: str) -> dict[tuple[int, int, str, str], object]:
    """{(layer, global expert, slice, A|B): value} of the per-expert keys of a PEFT state dict (or
    of its shapes). A transformers-5 fused-expert adapter (PEFT's target_parameters) is refused."""
    out = {}
    for k, t in sd.items():
        if PEFT_FUSED_KEY.search(k):
            raise FtcoreError(
                f"the adapter holds {k}: PEFT's fused-expert layout (target_parameters on "
                "transformers 5), which ftcore does not read", field=field,
                fix="an adapter in the per-expert layout (experts.<k>.gate_proj...; what ftcore "
                    "writes and PEFT converts on load), or retrain it with ftcore",
            )  # fmt: skip
        m = PEFT_EXPERT_KEY.search(k)
        if m and m.group(3) in FROM_HF:
            out[(int(m.group(1)), int(m.group(2)), FROM_HF[m.group(3)], m.group(4))] = t
    return out


def check_expert_shapes(adapter_dir, shapes: dict, model_cfg, egeo, r: int) -> None:
    """Refuse expert tensors that do not fit the model (another base: layers, experts, shapes), and
    PEFT's fused-expert layout, before anything is built. egeo: one expert's Geometry."""
    experts = int(getattr(model_cfg, "num_experts", None) or 0)
    dense = set(getattr(model_cfg, "moe_dense_layers", None) or [])
    for (layer, k, s, ab), shape in by_expert(shapes, "peft.adapter_path").items():
        out, inp = egeo.out_in(s)
        want = (r, inp) if ab == "A" else (out, r)
        fits = layer < model_cfg.num_layers and layer not in dense and k < experts
        if not fits or tuple(shape) != want:
            raise FtcoreError(
                f"{adapter_dir}: layers.{layer}.experts.{k}.{s}.lora_{ab} has shape {tuple(shape)}; "
                f"this model ({model_cfg.num_layers} layers, {experts} experts) needs "
                f"{want if fits else 'no such expert'}: the adapter was trained on another base",
                field="peft.adapter_path", fix="use the adapter with the base model it was trained on",
            )  # fmt: skip


def is_expert_key(k: str) -> bool:
    return bool(PEFT_EXPERT_KEY.search(k) or PEFT_FUSED_KEY.search(k))


def check_no_qlora(cfg) -> None:
    """QLoRA on a mixture of experts, refused before its targets are resolved (the default target,
    linear_qkv, is no module of latent attention: that error would send the user the wrong way)."""
    if cfg.peft.name == "qlora" and is_moe(cfg.model):
        raise FtcoreError(
            "QLoRA on a mixture of experts is not supported: ftcore's NF4 linears do not run "
            "inside megatron's expert layers", field="peft.name",
            fix="peft=lora (bf16 experts; plan with ep to fit them)",
        )  # fmt: skip


def check_moe_targets(cfg, targets, plan: dict) -> None:
    """Refuse what LoRA on a mixture of experts cannot do: the router on a dense model, a half of the
    experts' fused gate_up (PEFT refuses it on transformers 5), and the two LoraConfig settings
    PEFT cannot apply to fused experts (dropout, rsLoRA on the doubled gate_up rank)."""
    field = "peft.target_modules"
    if not is_moe(cfg.model):
        if "router" in plan:
            raise FtcoreError("the router is a mixture of experts' module; this model is dense",
                              field=field, fix="drop gate/router from peft.target_modules")  # fmt: skip
        return
    check_no_qlora(cfg)
    p = cfg.peft
    fc1 = set(plan.get("linear_fc1", {}))
    te = (cfg.get("cluster") or {}).get("device", "cpu") != "cpu" and (
        cfg.precision.get("te_layers", True)
    )
    etp = int((cfg.get("parallel") or {}).get("etp", 1))
    if (fc1 or "linear_fc2" in plan) and te and etp > 1:
        raise FtcoreError(
            f"LoRA on the experts with parallel.etp={etp} on Transformer Engine's per-expert "
            "linears: megatron hands TE no expert TP group there (it splits them itself), which "
            "ftcore's expert adapters have not been built for", field="parallel.etp",
            fix="parallel.etp=1 (experts whole on their EP rank), or precision.te_layers=false",
        )  # fmt: skip
    if len(fc1) == 1:
        raise FtcoreError(
            f"{next(iter(fc1))} without {({'gate_proj', 'up_proj'} - fc1).pop()}: transformers 5 fuses "
            "the experts' gate and up projections, and PEFT refuses an adapter on one half",
            field=field, fix="target both gate_proj and up_proj (or linear_fc1)",
        )  # fmt: skip
    if fc1 or "linear_fc2" in plan:
        if p.lora_dropout:
            raise FtcoreError(
                "PEFT applies no dropout on experts (its ParamWrapper refuses lora_dropout != 0), "
                "so it could not load this adapter", field="peft.lora_dropout",
                fix="peft.lora_dropout=0.0 with expert targets",
            )  # fmt: skip
        if p.use_rslora and fc1:
            raise FtcoreError(
                "PEFT fuses the experts' gate and up adapters into one of rank 2r and alpha 2*alpha, "
                "which changes rsLoRA's scale alpha/sqrt(r)", field="peft.use_rslora",
                fix="peft.use_rslora=false with gate_proj/up_proj on a mixture of experts",
            )  # fmt: skip
