"""What each number of a plan rests on: measured, fitted, or assumed. A plan for hardware nobody
here has run on is a prediction; the label says how far to trust each part of it."""

from __future__ import annotations

from ftcore.planner import calibration, host
from ftcore.planner.params import is_moe

SPEED = {  # calibration.py says what each fit is to
    "h100": "fitted: to the published H100 rows (tests/data/published_throughput.csv; each "
    "within 7.1% when held out of the fit, docs/planner.md)",
    "h200": "assumed: H100's fitted constants on H200's datasheet rates (no published H200 row)",
    "gb200": "fitted: to the one published GB200 dense row (no other row to check it out of "
    "sample; the held-out GB200 and B200 rows within 7%, docs/planner.md)",
    "b200": "assumed: GB200's fitted dense constants on B200's datasheet rates (the two held-out "
    "B200 rows within 2%)",
    "gb300": "fitted: to the published GB300 SFT and 405B rows (the held-out GB300 LoRA row "
    "within 5%)",
    "local_cpu": "fitted: to the layouts_cpu benchmark (2 CPU workers, one thread each)",
}


MOE_SPEED = {  # calibration.py and docs/planner.md say what each is fitted to
    "h100": "fitted: expert GEMM size and all-to-all overlap to one H100 row per Qwen3 model "
    "(Megatron-Bridge 25.11; the 26.02 rows held out within 5%)",
    "h200": "assumed: H100's MoE constants",
    "b200": "fitted: Blackwell's MoE constants and the x86 host's launch time to 15 Blackwell rows "
    "of Megatron-Bridge 25.09, 26.02 and 26.02.01 (the six 25.11 rows held out: median 9.4%, "
    "worst 15.6%)",
    "gb200": "fitted: Blackwell's MoE constants to 15 Blackwell rows of Megatron-Bridge 25.09, "
    "26.02 and 26.02.01 (the six 25.11 rows held out: median 9.4%, worst 15.6%)",
    "gb300": "fitted: Blackwell's MoE constants to 15 Blackwell rows of Megatron-Bridge 25.09, "
    "26.02 and 26.02.01 (the six 25.11 rows held out: median 9.4%, worst 15.6%)",
    "local_cpu": "assumed: no MoE constants (a CPU MoE run is priced by the dense constants)",
}


def labels(cfg) -> dict[str, str]:
    """One label per kind of number in the plan."""
    c = cfg.cluster
    gpu = c.device != "cpu"
    speed = SPEED.get(c.name, "assumed: default constants (no calibration for this cluster)")
    # nvlink_gbps is a datasheet fact on GPU clusters (fitted only for local_cpu): not an override
    mine = [k for k in calibration.KEYS if k != "nvlink_gbps" and getattr(c, k, None) is not None]
    if mine:
        speed += f"; set by you: {', '.join(mine)}"
    out = {
        "model_state": "measured: megatron's allocation per rank, equal to the byte (on CPU)",
        "activations": "assumed: the CPU-measured accounting, not yet measured on a GPU"
        if gpu
        else "measured: within 10% of the tensors saved for backward (on CPU)",
        "reserve": "assumed: an allowance for the CUDA context, NCCL and workspaces"
        if gpu
        else "fitted: with the layouts_cpu benchmark",
        "hardware_rates": "measured: this host's probed matmul rate and bandwidth"
        if host.probes(cfg)
        else f"datasheet: conf/cluster/{c.name}.yaml",
        "speed": speed,
    }
    if is_moe(cfg.model):
        out["model_state"] = (
            "measured: megatron's allocation per rank, equal to the byte on CPU (SequentialMLP "
            "experts, expert DDP buffers over the expert data-parallel group); element counts "
            "equal the GPU build's (dry build)"
        )
        out["moe_routing"] = (
            "assumed: the busiest EP rank receives plan.moe_imbalance x the mean routed tokens "
            "(moe.capacity_factor where set); not yet measured"
        )
        out["moe_speed"] = MOE_SPEED.get(c.name, "assumed: no MoE constants for this cluster")
        if gpu and not (cfg.precision.te_layers and cfg.peft.name != "qlora"):
            out["moe_speed"] += (
                "; this run builds megatron's local spec (precision.te_layers=false, for "
                "adapters on each expert): its SequentialMLP launches each local expert's GEMMs "
                "and adapters apart, priced at the grouped experts' rates (the launches are not "
                "priced: optimistic), and attention runs through ftcore's SDPA path, priced as "
                "TE's flash attention"
            )
    o = getattr(cfg, "objective", None)
    if o is not None and o.name == "dpo" and getattr(o, "precompute_ref", False):
        out["dpo_reference"] = (
            "objective.precompute_ref: no reference copy and no reference forward per step; "
            "a one-time forward pass over every pair before step 1 (not in the step time)"
        )
    return out
