"""Config checks in the pinned order of docs/design.md: schema (Hydra, at compose time), divisibility,
hardware, memory fit, world size. All run before any model is built; each failure is one
FtcoreError naming the field and the fix."""

from __future__ import annotations

import copy
import math

from omegaconf import DictConfig

from ftcore.config.families import FAMILIES
from ftcore.config.ranges import check_ranges
from ftcore.errors import FtcoreError
from ftcore.planner import cp
from ftcore.planner.layers import split_for

CHOICES = {
    "parallel.recompute": ("none", "selective", "full"),
    "parallel.cp_comm_type": cp.COMM_TYPES,
    "model.init_method": ("auto", "layout_independent", "sharded"),
    "model.family": tuple(FAMILIES),
    "peft.name": ("none", "lora", "qlora"),
    "data.format": (
        "auto",
        "instruction",
        "chat",
        "prompt_completion",
        "text",
        "preference",
        "prompt",
    ),
    "data.truncate": ("right", "drop"),
    "data.on_bad_record": ("error", "skip"),
    "logger.wandb.mode": ("disabled", "offline", "online"),
    "checkpoint.resume": None,  # auto | never | PATH
    "plan.format": ("table", "json"),
}


def world_size_of(cfg: DictConfig, launched: int) -> int:
    """world = cluster.num_gpus when set, else the processes actually launched (docs/design.md)."""
    return cfg.cluster.num_gpus if cfg.cluster.num_gpus is not None else launched


def data_parallel_size(cfg: DictConfig, world: int) -> int:
    p = cfg.parallel
    return world // (p.tp * p.pp * p.cp)


def check_choices(cfg: DictConfig) -> None:
    for key, allowed in CHOICES.items():
        if allowed is None:
            continue
        value = cfg
        for part in key.split("."):
            value = value[part]
        if value not in allowed:
            raise FtcoreError(f"{value!r} is not one of {', '.join(allowed)}", field=key,
                              fix=f"{key}={allowed[0]} (or {', '.join(allowed[1:])})")  # fmt: skip
    from ftcore.validation.objective import check_objective

    check_objective(cfg)  # objective=dpo: TRL's loss names, label_smoothing, the reference


def tp_choices(cfg: DictConfig, world: int | None = None) -> str:
    """Every constraint on tp at once, and the values that meet them all, so that following one
    error's fix does not walk into the next: tp divides the heads, the KV heads and the MLP width,
    and tp*pp*cp divides the world (when known)."""
    m, p = cfg.model, cfg.parallel
    ok = [
        tp
        for tp in range(1, m.num_attention_heads + 1)
        if not (m.num_attention_heads % tp or m.num_query_groups % tp or m.ffn_hidden_size % tp)
        and (world is None or world % (tp * p.pp * p.cp) == 0)
    ]
    rules = (f"tp divides num_attention_heads={m.num_attention_heads}, num_query_groups="
             f"{m.num_query_groups} and ffn_hidden_size={m.ffn_hidden_size}")  # fmt: skip
    if world is not None:
        rules += f", and tp*pp*cp (pp={p.pp}, cp={p.cp}) divides the world size {world}"
    pick = (
        f"parallel.tp={' or '.join(map(str, ok))}"
        if ok
        else "no tp does: change pp/cp or the world size"
    )
    return f"{pick} ({rules})"


def check_divisibility(cfg: DictConfig, world: int | None = None) -> None:
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name in ("tp", "pp", "vp", "cp"):
        if p[name] < 1:
            raise FtcoreError(f"must be >= 1, got {p[name]}", field=f"parallel.{name}",
                              fix=f"parallel.{name}=1 (or more)")  # fmt: skip
    if m.num_attention_heads % p.tp:
        raise FtcoreError(
            f"tp={p.tp} does not divide num_attention_heads={m.num_attention_heads}",
            field="parallel.tp", fix=tp_choices(cfg, world),
        )  # fmt: skip
    if m.num_query_groups % p.tp:
        raise FtcoreError(
            f"tp={p.tp} does not divide num_query_groups (kv heads)={m.num_query_groups}",
            field="parallel.tp", fix=tp_choices(cfg, world),
        )  # fmt: skip
    if m.get("kv_channels") is None and m.hidden_size % m.num_attention_heads:
        raise FtcoreError(
            f"num_attention_heads={m.num_attention_heads} does not divide hidden_size={m.hidden_size}",
            field="model.hidden_size", fix="set model.kv_channels (the head dim) or a divisible size",
        )  # fmt: skip
    if m.num_attention_heads % m.num_query_groups:
        raise FtcoreError(
            f"num_query_groups={m.num_query_groups} does not divide num_attention_heads",
            field="model.num_query_groups",
            fix="the model's own num_key_value_heads (model.hf_path reads it from config.json)",
        )
    if m.ffn_hidden_size % p.tp:
        raise FtcoreError(
            f"tp={p.tp} does not divide ffn_hidden_size={m.ffn_hidden_size}",
            field="parallel.tp",
            fix=tp_choices(cfg, world),
        )
    if p.sp and p.tp == 1:
        raise FtcoreError(
            "sequence parallel needs tp > 1",
            field="parallel.sp",
            fix="set parallel.tp>1 or parallel.sp=false",
        )
    split_for(cfg)
    check_sequence(cfg)
    check_context_parallel(cfg)
    check_accuracy_decodes(cfg)
    if cfg.data.packing and cfg.cluster.device == "cuda" and t.micro_batch_size != 1:
        raise FtcoreError(
            "packed sequences go to Transformer Engine as one THD row per micro-batch",
            field="train.micro_batch_size",
            fix="set train.micro_batch_size=1 with data.packing=true on GPU (pack longer rows instead)",
        )
    if t.micro_batch_size < 1 or t.global_batch_size % t.micro_batch_size:
        raise FtcoreError(
            f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size={t.micro_batch_size}",
            field="train.global_batch_size",
            fix="make train.global_batch_size a multiple of train.micro_batch_size",
        )


def check_sequence(cfg: DictConfig) -> None:
    """data.seq_len within the model's positions and divisible the way the layout cuts it; a
    context-parallel layout TE accepts (planner/cp.py: the layout search applies the same rules)."""
    m, p, s = cfg.model, cfg.parallel, cfg.data.seq_len
    if s > m.max_position_embeddings and m.hf_path:  # the user's own checkpoint, not a preset's
        raise FtcoreError(
            f"seq_len={s} is beyond the {m.max_position_embeddings} positions of the checkpoint "
            f"{m.hf_path} (max_position_embeddings in its config.json)",
            field="data.seq_len",
            fix=f"data.seq_len={m.max_position_embeddings} (or less: a preset's seq_len is for "
            "its own model)",
        )
    if s > m.max_position_embeddings:
        raise FtcoreError(
            f"seq_len={s} is beyond the {m.max_position_embeddings} positions of model "
            f"{m.name} (model.max_position_embeddings)",
            field="data.seq_len",
            fix=f"use data.seq_len<={m.max_position_embeddings}, or a model with more positions "
            "(e.g. model=llama31_70b: 131072, with Llama 3.1's RoPE scaling)",
        )
    comm = cp.comm_type(p)
    check_hierarchical_sizes(p)
    problem = cp.layout_problem(
        m, p.tp, p.cp, comm, cp.hierarchical_sizes(p), thd=cp.thd_under_te(cfg),
        local=cp.local_on_gpu(cfg),
    )  # fmt: skip
    if problem:
        field, what, fix = problem
        raise FtcoreError(what, field=field, fix=fix)
    mult = cp.sequence_multiple(p)
    if s % mult:
        raise FtcoreError(
            f"seq_len={s} must divide by {mult}: 2*cp context-parallel chunks (at cp > 1), each "
            "split over tp under sp",
            field="data.seq_len",
            fix=f"use a multiple of {mult}, e.g. {-(-s // mult) * mult}",
        )


def check_hierarchical_sizes(p) -> None:
    """parallel.hierarchical_cp_sizes: set exactly when cp_comm_type=a2a+p2p (a setting that
    would be ignored is refused), as at least two group sizes whose product is cp."""
    sizes = list(getattr(p, "hierarchical_cp_sizes", None) or [])
    hier = p.cp > 1 and cp.comm_type(p) == "a2a+p2p"
    if sizes and not hier:
        raise FtcoreError(
            f"hierarchical_cp_sizes={sizes} is only used with cp > 1 and cp_comm_type=a2a+p2p",
            field="parallel.hierarchical_cp_sizes",
            fix="remove it, or set parallel.cp_comm_type=a2a+p2p",
        )
    if hier and (len(sizes) < 2 or min(sizes) < 1 or math.prod(sizes) != p.cp):
        a2a = 2 if p.cp % 2 == 0 else p.cp
        raise FtcoreError(
            f"cp_comm_type=a2a+p2p needs the sizes of its all-to-all and ring groups, whose product "
            f"is cp={p.cp} (got {sizes or 'none'})",
            field="parallel.hierarchical_cp_sizes",
            fix=f"e.g. parallel.hierarchical_cp_sizes=[{a2a},{p.cp // a2a}] (all-to-all inside a "
            "node, the ring across nodes)",
        )


def check_context_parallel(cfg: DictConfig) -> None:
    p = cfg.parallel
    if p.cp == 1:
        return
    if cfg.eval.accuracy:
        raise FtcoreError(
            "exact-match accuracy generates token by token, which context parallelism does not "
            "shard (ftcore.generate refuses cp > 1 too)",
            field="eval.accuracy", fix="set eval.accuracy=false, or evaluate at parallel.cp=1",
        )  # fmt: skip
    m = cfg.data.pack_multiple
    if cfg.data.packing and m % (2 * p.cp):
        raise FtcoreError(
            f"packed rows keep room for CP padding where 2*cp divides data.pack_multiple={m}, "
            f"not at cp={p.cp} (docs/context_parallel.md)",
            field="data.pack_multiple",
            fix=f"set data.pack_multiple={math.lcm(m, 2 * p.cp)}, and the same in the cp=1 run "
            "it is compared with",
        )


def check_accuracy_decodes(cfg: DictConfig) -> None:
    """eval.accuracy during training decodes with the training model itself, whose FP8/FP4 GEMMs,
    userbuffers cannot run one token per row (precision/decode.py). ftcore.eval
    derives a config that can; training cannot change its model, so it refuses here."""
    from ftcore.precision.decode import decode_problems

    problems = decode_problems(cfg) if cfg.eval.accuracy else []
    if problems:
        raise FtcoreError(
            "exact-match accuracy decodes one token per row with the training model, which "
            f"cannot run it: {'; '.join(f'{k}: {why}' for k, why in problems)}",
            field="eval.accuracy",
            fix="set eval.accuracy=false, and score the trained checkpoint with python -m "
            "ftcore.eval eval.accuracy=true (it decodes in BF16, without userbuffers)",
        )
    if cfg.eval.accuracy:
        check_decoding_schedule(cfg, "eval.accuracy", "set eval.accuracy=false, or score the "
                                "checkpoint with ftcore.eval eval.accuracy=true at parallel.vp=1")  # fmt: skip


def check_generation(cfg: DictConfig) -> None:
    """ftcore.generate: one new position per forward cannot be cut into 2*cp chunks, and one
    micro-batch per forward is what megatron's interleaved schedule refuses (it needs pp)."""
    if cfg.parallel.cp > 1:
        raise FtcoreError(
            f"generation does not run under context parallelism (parallel.cp={cfg.parallel.cp})",
            field="parallel.cp", fix="generate with parallel.cp=1 (checkpoints load at any cp)",
        )  # fmt: skip
    check_decoding_schedule(
        cfg, "parallel.vp", "generate with parallel.vp=1 (checkpoints load at any vp)"
    )


def check_decoding_schedule(cfg: DictConfig, field: str, fix: str) -> None:
    """Decoding feeds megatron's schedule one micro-batch per forward; the interleaved schedule
    (vp > 1) refuses fewer than pp micro-batches ("contiguous micro-batches ... [PP, M=1]")."""
    p = cfg.parallel
    if p.pp > 1 and p.vp > 1:
        raise FtcoreError(
            f"decoding runs one micro-batch per forward, which the interleaved pipeline schedule "
            f"(parallel.vp={p.vp}) does not run",
            field=field, fix=fix,
        )  # fmt: skip


def check_world(cfg: DictConfig, world: int) -> int:
    """World-size checks; returns dp."""
    p, t = cfg.parallel, cfg.train
    if world % (p.tp * p.pp * p.cp):
        raise FtcoreError(
            f"world size {world} is not divisible by tp*pp*cp = {p.tp}*{p.pp}*{p.cp} = {p.tp * p.pp * p.cp}",
            field="parallel.tp/parallel.pp/parallel.cp",
            fix="launch a multiple of tp*pp*cp processes (launcher.nproc_per_node or cluster.num_gpus), "
            f"or {tp_choices(cfg, world)}",
        )
    dp = data_parallel_size(cfg, world)
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise FtcoreError(
            f"global_batch_size={t.global_batch_size} is not divisible by micro_batch_size*dp = "
            f"{t.micro_batch_size}*{dp}",
            field="train.global_batch_size",
            fix=f"use a multiple of {t.micro_batch_size * dp}",
        )
    num_micro = t.global_batch_size // (t.micro_batch_size * dp)
    if p.vp > 1 and num_micro % p.pp:
        raise FtcoreError(
            f"the interleaved schedule needs micro-batches per step ({num_micro}) divisible by pp={p.pp}",
            field="train.global_batch_size",
            fix=f"a global batch of a multiple of micro_batch_size * dp * pp = "
            f"{t.micro_batch_size * dp * p.pp}, or parallel.vp=1",
        )
    return dp


def check_for_launch(cfg: DictConfig, world: int, *, training: bool = True) -> int:
    """validate() before anything heavy is imported, with the HF model's shapes merged in (on a
    copy): the launching parent exits 2 before any worker starts, a single process before megatron
    is imported."""
    check_ranges(cfg)
    check_choices(cfg)
    from ftcore.config.presets import adapt
    from ftcore.validation import preflight

    checked = copy.deepcopy(cfg)
    adapt(checked, training=training, say=False)  # the workers adapt their own copy (and log it)
    preflight.check_inputs(checked)  # before the merge: a missing model.hf_path is named as missing
    merged = with_hf_shapes(checked)
    from ftcore.validation.objective import check_objective

    check_objective(merged)  # again with the HF model's kind: no DPO on a MoE checkpoint
    return check_layout(merged, world, training=training)


def with_hf_shapes(cfg: DictConfig) -> DictConfig:
    """A copy of cfg with model.hf_path's config.json merged in (cfg itself when there is none)."""
    if not cfg.model.hf_path:
        return cfg
    from ftcore.hf.config import merge_hf_config

    return merge_hf_config(copy.deepcopy(cfg))


def validate(cfg: DictConfig, launched: int, *, training: bool = True, device=None) -> int:
    """Run every check in the pinned order; returns the data-parallel size. `device`
    (hardware.Device) stands in for this machine's GPU: tests check a target GPU on CPU."""
    from ftcore.validation import preflight

    check_ranges(cfg)  # every numeric field in its range (ftcore/config/ranges.py) before any use
    check_choices(cfg)
    # every path exists, no adapter dropped, no adapters on a random base
    preflight.check_inputs(cfg)
    return check_layout(cfg, launched, training=training, device=device)


def check_layout(
    cfg: DictConfig, launched: int, *, training: bool = True, on_target: bool = False, device=None
) -> int:
    """validate() past the inputs: divisibility, PEFT, hardware, memory fit, world size; returns
    dp. `on_target`: the hardware of cluster.compute_capability, not this machine's (dry run);
    `device`: a simulated machine for the hardware check (see validate)."""
    from ftcore import planner
    from ftcore.precision import hardware
    from ftcore.validation import preflight

    check_divisibility(cfg, world_size_of(cfg, launched))
    from ftcore.data.formats import check_preference

    check_preference(cfg)  # preference pairs go with objective=dpo, and it with them
    from ftcore.data.formats import check_prompts

    check_prompts(cfg)  # prompt-only records go with objective=grpo, and it with them
    from ftcore.validation.moe_checks import check_moe

    check_moe(cfg, world_size_of(cfg, launched), training=training)  # ep, etp: docs/moe.md
    from ftcore.models import speed

    speed.check(cfg)  # overlap, recompute, fusions, CUDA graphs: ftcore's rules, then megatron's
    from ftcore.peft.config import check_config as check_peft

    check_peft(cfg)  # targets, rank, QLoRA x FP8/FP4, an adapter_path that fits the model
    if training and on_target:
        preflight.check_target_hardware(cfg)
    elif training:
        hardware.check_hardware(cfg, device)
        dev = device or hardware.this_device()
        if dev.cuda:
            speed.check_device(cfg, dev.te_version)  # userbuffers, CUDA graphs: TE on this GPU
    world = world_size_of(cfg, launched)
    if training:
        planner.check_fit(cfg, world)
    if training and cfg.cluster.num_gpus is not None and cfg.cluster.num_gpus != launched:
        raise FtcoreError(
            f"cluster.num_gpus={cfg.cluster.num_gpus} but {launched} processes were launched",
            field="cluster.num_gpus",
            fix="cluster.num_gpus=null (the world is the processes launched), or launch "
            f"{cfg.cluster.num_gpus}: launcher.nproc_per_node={cfg.cluster.num_gpus} here, that "
            "many under torchrun/srun",
        )
    return check_world(cfg, world)


def problems(cfg: DictConfig, launched: int, *, training: bool = True) -> list[str]:
    """Everything the SLURM dry run reports, one line each: the inputs (paths, adapter, base
    weights), then the pinned checks against the target cluster's hardware up to the first failure
    (each later check assumes the earlier ones passed). A bad choice stops it at once."""
    from ftcore.validation import preflight

    try:
        check_ranges(cfg)
        check_choices(cfg)
    except FtcoreError as e:
        return [str(e)]
    found: list[FtcoreError] = []
    for check in (
        preflight.check_inputs,
        lambda c: check_layout(with_hf_shapes(c), launched, training=training, on_target=True),
    ):
        try:
            check(cfg)
        except FtcoreError as e:
            if all(e.field != f.field for f in found):  # a missing hf_path fails the merge too
                found.append(e)
    return [str(e) for e in found]
