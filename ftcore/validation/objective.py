"""The `objective` section's rules (docs/preference.md, docs/grpo.md), checked with the choices
before anything is built: TRL 1.x's loss names, which of them read `label_smoothing`, one weight per
loss, which reference each fine-tuning mode can have, and GRPO's batch, layout and reward rules
(its reward functions are built here, so a user function that cannot be imported exits 2 before
any worker starts). Free of torch: this runs in the launching parent."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from ftcore.errors import FtcoreError

OBJECTIVES = ("sft", "dpo", "grpo")
# TRL 1.16's DPOConfig.loss_type values, and the ones ftcore computes (training/objectives/dpo/loss.py)
TRL_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair",
                  "sppo_hard", "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft",
                  "sigmoid_norm")  # fmt: skip
LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust", "sft")
# the losses whose TRL 1.16 definition reads label_smoothing, among ftcore's
SMOOTHED = ("robust",)


def check_objective(cfg: DictConfig) -> None:
    o = cfg.objective
    if o.name not in OBJECTIVES:
        raise FtcoreError(f"{o.name!r} is not one of {', '.join(OBJECTIVES)}", field="objective",
                          fix="objective=sft (next-token loss), objective=dpo (preference pairs) "
                          "or objective=grpo (online RL on prompts)")  # fmt: skip
    if o.name == "grpo":
        from ftcore.validation.grpo_checks import check_grpo

        check_grpo(cfg)
        return
    if o.name != "dpo":
        return
    if o.beta <= 0:
        raise FtcoreError(f"DPO's beta must be > 0, got {o.beta}", field="objective.beta",
                          fix="objective.beta=0.1 (TRL's default)")  # fmt: skip
    if not isinstance(o.loss_type, (list, tuple)) and not OmegaConf.is_list(o.loss_type):
        raise FtcoreError(f"DPO takes a list of losses, got {o.loss_type!r}",
                          field="objective.loss_type", fix="objective.loss_type=[sigmoid]")  # fmt: skip
    if cfg.model.get("num_experts"):
        # the router's auxiliary loss is scaled per target token (docs/moe.md); DPO's per pair
        raise FtcoreError("preference tuning of a mixture of experts is not built yet",
                          field="objective", fix="objective=sft for a MoE model, or a dense model")  # fmt: skip
    types = list(o.loss_type)
    if not types:
        raise FtcoreError("no loss is given", field="objective.loss_type",
                          fix="objective.loss_type=[sigmoid] (TRL's default)")  # fmt: skip
    for t in types:
        if t not in LOSS_TYPES:
            other = " (a TRL loss ftcore does not compute)" if t in TRL_LOSS_TYPES else ""
            raise FtcoreError(
                f"{t!r} is not one of TRL's loss names that ftcore computes: "
                f"{', '.join(LOSS_TYPES)}{other}",
                field="objective.loss_type",
                fix=f"objective.loss_type=[{LOSS_TYPES[0]}] (or a list of {', '.join(LOSS_TYPES)})",
            )
    if len(set(types)) != len(types):
        raise FtcoreError(f"a loss is named twice in {types}", field="objective.loss_type",
                          fix="name each loss once and weigh it with objective.loss_weights")  # fmt: skip
    w = o.loss_weights
    if w is not None and len(w) != len(types):
        raise FtcoreError(
            f"{len(w)} weights for {len(types)} losses {types}", field="objective.loss_weights",
            fix=f"give one weight per loss (e.g. objective.loss_weights=[{','.join(['1.0'] * len(types))}]) "
            "or objective.loss_weights=null (1.0 each)",
        )  # fmt: skip
    if o.label_smoothing != 0 and not any(t in SMOOTHED for t in types):
        raise FtcoreError(
            f"label_smoothing={o.label_smoothing} is ignored by {', '.join(types)}: in TRL 1.x only "
            f"{', '.join(SMOOTHED)} reads it (among {', '.join(LOSS_TYPES)})",
            field="objective.label_smoothing",
            fix="objective.label_smoothing=0.0, or objective.loss_type=[robust] (DPO with "
            "flipped-label noise)",
        )
    check_reference(cfg)


def check_reference(cfg: DictConfig) -> None:
    """LoRA's reference is the base with the adapters off (or base + ref_adapter_path); full
    fine-tuning's a frozen copy sharded like the policy; either, with precompute_ref, log-probs
    stored by a first pass (training/objectives/dpo/ref_store.py)."""
    o = cfg.objective
    if o.ref_adapter_path and cfg.peft.name == "none":
        raise FtcoreError(
            "a reference adapter needs adapters: with full fine-tuning there is none to switch",
            field="objective.ref_adapter_path",
            fix="peft=lora (the policy starts from the reference adapter), or remove it",
        )
    if o.ref_adapter_path and not Path(o.ref_adapter_path, "adapter_config.json").is_file():
        raise FtcoreError(
            f"{o.ref_adapter_path} is not a PEFT adapter directory (no adapter_config.json)",
            field="objective.ref_adapter_path",
            fix="the hf_adapter/ directory of the SFT run to start from",
        )
