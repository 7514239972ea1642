"""objective=grpo's rules (docs/grpo.md), before anything is built: TRL 1.16's loss names and
reward scalings, whole prompt groups in a step, the layouts ftcore's decoder generates on, the
reward functions (built, so a user function that cannot be imported exits 2 here), and the
settings of other objectives that would be ignored. Free of torch."""

from __future__ import annotations

from omegaconf import DictConfig

from ftcore.errors import FtcoreError

# TRL 1.16's GRPOConfig.loss_type values, and the ones ftcore computes (training/objectives/grpo/loss.py)
TRL_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo", "cispo", "sapo", "luspo", "vespo")
LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
SCALE_REWARDS = ("group", "batch", "none")


def check_grpo(cfg: DictConfig) -> None:
    o, t, p = cfg.objective, cfg.train, cfg.parallel
    lt = o.loss_type
    if not isinstance(lt, str) or lt not in LOSS_TYPES:
        other = " (a TRL loss ftcore does not compute)" if lt in TRL_LOSS_TYPES else ""
        raise FtcoreError(f"{lt!r} is not one of GRPO's losses that ftcore computes: "
                          f"{', '.join(LOSS_TYPES)}{other}", field="objective.loss_type",
                          fix="objective.loss_type=dapo (TRL's default), or grpo, dr_grpo, bnpo")  # fmt: skip
    if o.scale_rewards not in SCALE_REWARDS:
        raise FtcoreError(f"{o.scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}",
                          field="objective.scale_rewards", fix="objective.scale_rewards=group")  # fmt: skip
    if t.global_batch_size % o.num_generations:
        raise FtcoreError(
            f"train.global_batch_size={t.global_batch_size} (completions per step) is not a "
            f"multiple of objective.num_generations={o.num_generations}: a step takes whole groups",
            field="train.global_batch_size",
            fix=f"train.global_batch_size={max(1, t.global_batch_size // o.num_generations) * o.num_generations}",
        )  # fmt: skip
    if cfg.data.seq_len <= o.max_completion_length:
        raise FtcoreError(f"data.seq_len={cfg.data.seq_len} leaves no room for a prompt before "
                          f"objective.max_completion_length={o.max_completion_length} tokens",
                          field="data.seq_len", fix="data.seq_len = the longest prompt + max_completion_length")  # fmt: skip
    if cfg.data.packing:
        raise FtcoreError("objective=grpo's rows hold one completion each (TRL's layout), not packed",
                          field="data.packing", fix="data.packing=false")  # fmt: skip
    if cfg.model.get("num_experts"):
        raise FtcoreError("GRPO on a mixture of experts is not built yet", field="objective",
                          fix="a dense model, or objective=sft")  # fmt: skip
    if p.cp > 1:  # generation.check_generation's rule, named for the training run
        raise FtcoreError(f"ftcore's decoder does not generate under context parallelism (parallel.cp={p.cp})",
                          field="parallel.cp", fix="parallel.cp=1 (rollouts and updates share the layout)")  # fmt: skip
    if p.pp > 1 and p.vp > 1:
        raise FtcoreError(f"rollouts decode one micro-batch per forward, which the interleaved schedule "
                          f"(parallel.vp={p.vp}) does not run", field="parallel.vp", fix="parallel.vp=1")  # fmt: skip
    from ftcore.precision.decode import decode_problems

    problems = decode_problems(cfg)  # the rollouts decode one token per row on the training model
    if problems:
        key, why = problems[0]
        raise FtcoreError(f"ftcore's rollouts decode one token per row with the training model: {why}",
                          field=key, fix="precision=bf16 and parallel.tp_comm_overlap=false "
                          "(FP8/FP4 GEMMs and userbuffers want training shapes)")  # fmt: skip
    if t.epochs is not None:
        raise FtcoreError("train.epochs is not read by objective=grpo", field="train.epochs",
                          fix="train.max_steps=N (a step takes global_batch_size / num_generations prompts)")  # fmt: skip
    if cfg.eval.interval or cfg.eval.accuracy:
        raise FtcoreError("objective=grpo has no held-out evaluation yet", field="eval.interval",
                          fix="eval.interval=0 eval.accuracy=false (the rewards are logged every rollout)")  # fmt: skip
    ckpt = cfg.checkpoint.interval
    if ckpt and o.num_iterations > 1 and ckpt % o.num_iterations:
        raise FtcoreError(
            f"checkpoint.interval={ckpt} saves in the middle of a rollout's "
            f"{o.num_iterations} updates (objective.num_iterations), which a resume cannot restore",
            field="checkpoint.interval", fix=f"a multiple of {o.num_iterations}",
        )  # fmt: skip
    dpo_only = {"loss_weights": None, "label_smoothing": 0.0, "ref_adapter_path": None,
                "precompute_ref": False}  # fmt: skip
    for key, default in dpo_only.items():
        if o[key] != default:
            raise FtcoreError(f"objective.{key} is DPO's, not read by objective=grpo",
                              field=f"objective.{key}", fix="remove it (the reference of GRPO is "
                              "the starting policy, as TRL's)")  # fmt: skip
    from ftcore.data.rewards import build

    build(cfg)
