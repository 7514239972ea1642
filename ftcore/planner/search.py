"""Enumerate layouts (tp, pp, vp, cp, dp, micro batch, recompute) and rank those that fit.

Candidates respect what megatron and ftcore's validation accept: tp divides heads, kv groups and
the ffn and stays inside one NVLink domain; the layers split over pp*vp (evenly or the megatron
way; where neither works, as uneven stages: the first stage's count by layers.first_stage_rule, the
rest shared equally, e.g. 61 layers at pp=4 as 13+16+16+16); cp cuts the sequence into 2*cp chunks (each split over tp under sp) with each KV exchange TE
accepts for the model's heads (cp.py, the rules validation applies; GPU only: the CPU runtime's
CP attention is not searched); the global batch divides by micro batch x dp, and the interleaved
schedule gets a multiple of pp micro-batches.
"""

from __future__ import annotations

from itertools import product

from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.planner import cp as cp_rules
from ftcore.planner import ep as ep_rules
from ftcore.planner import memory
from ftcore.planner.layers import first_stage_rule, split_layers
from ftcore.planner.memory import GiB, all_stages
from ftcore.planner.params import is_moe
from ftcore.planner.throughput import throughput
from ftcore.planner.view import PlanView, replace, view

POW2 = (1, 2, 4, 8, 16, 32, 64)


def _with(cfg, **lay) -> PlanView:
    lay = dict(lay)
    mbs = lay.pop("micro_batch_size", None)
    lay["sp"] = lay.get("tp", cfg.parallel.tp) > 1
    train = {"micro_batch_size": mbs} if mbs is not None else {}
    return replace(cfg, parallel=lay, train=train)


def _tp_options(cfg: DictConfig) -> list[int]:
    m, c = cfg.model, cfg.cluster
    limit = max(min(c.nvlink_domain, c.gpus_per_node), 1)
    return [
        t
        for t in POW2
        if t <= limit
        and m.num_attention_heads % t == 0
        and m.num_query_groups % t == 0
        and m.ffn_hidden_size % t == 0
    ]


def _cp_options(cfg: DictConfig, tp: int) -> list[tuple[int, str | None]]:
    """(cp, cp_comm_type) pairs validation accepts for this tp (with sp when tp > 1): the same
    rules as validation/checks.py's check_sequence (planner/cp.py). cp=1 keeps the config's type."""
    out: list[tuple[int, str | None]] = [(1, None)]
    thd, local = cp_rules.thd_under_te(cfg), cp_rules.local_on_gpu(cfg)
    for c in (2, 4, 8, 16):
        if cfg.data.seq_len % cp_rules.seq_multiple(tp, tp > 1, c):
            continue
        out += [
            (c, k)
            for k in cp_rules.SEARCHED
            if not cp_rules.layout_problem(cfg.model, tp, c, k, thd=thd, local=local)
        ]
    return out


def _splits(num_layers: int, pp: int, vp: int) -> bool:
    try:
        split_layers(num_layers, pp, vp)
    except FtcoreError:
        return False
    return True


STAGE_KEYS = ("pp_first_stage_layers", "pp_last_stage_layers")


def _stages(cfg, pp: int, vp: int) -> dict | None:
    """A layout's stage keys: none for megatron's own split, the first stage's count where that
    has no split, None where neither works. A key the config set is reset (None), so that the
    row's overrides clear it."""
    n = cfg.model.num_layers
    keys = {k: None for k in STAGE_KEYS if getattr(cfg.parallel, k, None) is not None}
    if _splits(n, pp, vp):
        return keys
    first = first_stage_rule(n, pp, vp)
    return None if first is None else {**keys, "pp_first_stage_layers": first}


def layouts(cfg: DictConfig, world: int, *, vary_recompute: bool = True):
    """Every accepted (tp, pp, vp, cp, micro batch, recompute; ep and etp for a MoE model) for
    `world` GPUs."""
    m, t = cfg.model, cfg.train
    gpu = cfg.cluster.device != "cpu"
    recomputes = ("none", "selective", "full") if vary_recompute else (cfg.parallel.recompute,)
    moe = is_moe(m)
    mbss = (1,) if cfg.data.packing and cfg.cluster.device == "cuda" else (1, 2, 4)  # checks.py
    for tp in _tp_options(cfg):
        for cp, comm in _cp_options(cfg, tp) if gpu else [(1, None)]:
            for pp in [p for p in POW2 if p <= m.num_layers]:
                if world % (tp * cp * pp):
                    continue
                dp = world // (tp * cp * pp)
                for mbs, (ep, etp) in product(mbss, ep_rules.options(cfg, tp, world // pp)):
                    if t.global_batch_size % (mbs * dp):
                        continue
                    micro = t.global_batch_size // (mbs * dp)
                    vps = [1] + (
                        [v for v in (2, 4, 5, 8, 10, 20) if micro % pp == 0] if pp > 1 else []
                    )
                    for vp in vps:
                        stages = _stages(cfg, pp, vp)
                        if stages is None:
                            continue
                        for rc in recomputes:
                            lay = dict(tp=tp, pp=pp, vp=vp, cp=cp, micro_batch_size=mbs,
                                       recompute=rc, **stages)  # fmt: skip
                            if moe:
                                lay.update(ep=ep, etp=etp)
                            yield dict(lay, cp_comm_type=comm) if comm else lay


def fits(cfg: DictConfig, world: int) -> tuple[bool, float]:
    """(fits with plan.headroom kept free, the worst stage's GiB)."""
    worst = max(all_stages(cfg, world), key=lambda s: s.total)
    return memory.fits(cfg, worst, cfg.cluster.gpu_mem_gib * GiB), worst.total / GiB


def overrides(row: dict) -> str:
    """The command-line overrides that select this layout (dp follows from the world size)."""
    comm = f" parallel.cp_comm_type={row['cp_comm_type']}" if "cp_comm_type" in row else ""
    if "ep" in row:
        comm += f" parallel.ep={row['ep']} parallel.etp={row['etp']}"
    for k in STAGE_KEYS:
        if k in row:
            comm += f" parallel.{k}={'null' if row[k] is None else row[k]}"
    return (
        f"parallel.tp={row['tp']} parallel.pp={row['pp']} parallel.vp={row['vp']} "
        f"parallel.cp={row['cp']}{comm} parallel.sp={str(row['sp']).lower()} "
        f"parallel.recompute={row['recompute']} train.micro_batch_size={row['micro_batch_size']}"
    )


NEAR = 0.02  # layouts this close in predicted speed, with the same tp/pp/cp, are one row


def search(cfg: DictConfig, world: int, top: int = 10) -> list[dict]:
    """Distinct layouts that fit on `world` GPUs, fastest first. A layout within 2% of the speed
    of a faster one with the same tp, pp and cp (another vp, micro batch or recompute setting) is
    not a new choice: it is counted in that row's `variants` instead of filling the list."""
    cfg = view(cfg)
    rows = []
    for lay in layouts(cfg, world):
        c = _with(cfg, **lay)
        ok, total = fits(c, world)
        if not ok:
            continue
        speed = throughput(c, world)
        rows.append(
            dict(
                lay,
                dp=world // (lay["tp"] * lay["pp"] * lay["cp"]),
                sp=bool(c.parallel.sp),
                memory_gib=total,
                spare_gib=c.cluster.gpu_mem_gib - total,
                tokens_per_s_per_gpu=speed["tokens_per_s_per_gpu"],
                mfu=speed["mfu"],
            )
        )
    rows.sort(key=lambda r: -r["tokens_per_s_per_gpu"])
    kept: list[dict] = []
    for r in rows:
        same = ("tp", "pp", "cp", "ep", "etp")
        twin = next((k for k in kept if all(k.get(f) == r.get(f) for f in same)
                     and r["tokens_per_s_per_gpu"] >= (1 - NEAR) * k["tokens_per_s_per_gpu"]), None)  # fmt: skip
        if twin is not None:
            twin["variants"] += 1
        else:
            kept.append(dict(r, variants=1, overrides=overrides(r)))
    return kept[:top]


def _widest_ep(cfg, lay: dict, world: int) -> int:
    return max(e * t for e, t in ep_rules.options(cfg, lay["tp"], world // lay["pp"]))


def smallest_fit(cfg: DictConfig, max_gpus: int = 4096) -> int | None:
    """Fewest GPUs (a power of two, or whole nodes beyond one node) on which some layout fits,
    keeping the config's precision, PEFT, sequence and batch sizes."""
    cfg = view(cfg)
    per_node = max(cfg.cluster.gpus_per_node, 1)
    counts = [n for n in POW2 if n < per_node] + [
        per_node * k for k in POW2 if per_node * k <= max_gpus
    ]
    for n in counts:
        for lay in layouts(cfg, n):
            if lay["recompute"] != "full" or lay["micro_batch_size"] != 1:
                continue  # the most frugal settings decide whether n GPUs can hold it
            if "ep" in lay and lay["ep"] * lay["etp"] != _widest_ep(cfg, lay, n):
                continue  # and the experts spread as wide as the layout allows
            if fits(_with(cfg, **lay), n)[0]:
                return n
    return None
