"""The GPU workers' environment, in one place for every launcher (launch/node.py under SLURM,
runtime/dist.launch_local_workers for one node) and for the process itself at its start
(`at_process_start`: a plain torchrun gets it too): what the published Megatron-Bridge recipes
set, chosen per GPU generation (cluster.compute_capability) and per overlap setting.

A value the user exported wins. A value ftcore chose is listed in FTCORE_AUTO_ENV, so a launcher
started from inside another one (the benchmark's configurations under a SLURM launcher) chooses
again for its own config instead of inheriting the outer choice.
"""

from __future__ import annotations

from collections.abc import MutableMapping

AUTO = "FTCORE_AUTO_ENV"
SM_MARGIN = "20"  # SMs TE's norm kernels leave to the communication kernels running beside them
P2P_CHUNK = "2097152"  # NCCL_P2P_NET_CHUNKSIZE for pipeline sends between nodes (2 MiB)

BASE = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # a failed collective ends the process, not a hang
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "NCCL_DEBUG": "WARN",
    # grow segments instead of caching many sizes: less fragmentation with variable packed rows
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    "NCCL_NVLS_ENABLE": "0",  # NVLink SHARP buffers cost GPU memory; the recipes leave it off
}


def max_connections(cfg) -> str:
    """CUDA_DEVICE_MAX_CONNECTIONS. Hopper has to issue kernels in order for megatron's TP/SP
    communication to start before the GEMM that needs it (and for TE userbuffers): 1 with TP > 1. Otherwise, and on Blackwell (compute capability >= 10, whose overlap does
    not rely on launch order), 32 lets independent streams (DP and pipeline traffic) run side by side."""
    cc = cfg.cluster.compute_capability or 9.0
    p = cfg.parallel
    if cc < 10.0 and p.tp > 1:
        return "1"
    return "32"


def gpu_env(cfg, nnodes: int = 1) -> dict[str, str]:
    """The variables ftcore sets for a GPU worker of this config (see the module docstring)."""
    p = cfg.parallel
    env = dict(BASE, CUDA_DEVICE_MAX_CONNECTIONS=max_connections(cfg))
    if p.tp_comm_overlap or p.overlap_grad_reduce or p.overlap_param_gather or p.overlap_p2p_comm:
        # communication kernels first in the queue; TE's norms leave SMs to them
        env["TORCH_NCCL_HIGH_PRIORITY"] = "1"
        env["NVTE_FWD_LAYERNORM_SM_MARGIN"] = SM_MARGIN
        env["NVTE_BWD_LAYERNORM_SM_MARGIN"] = SM_MARGIN
    per_node = max(int(cfg.cluster.gpus_per_node or 1), 1)
    model_span = p.tp * p.cp * p.pp  # consecutive ranks of one model replica
    if (
        p.pp > 1
        and (nnodes > 1 or (cfg.cluster.num_gpus or 0) > per_node)
        and model_span > per_node
    ):
        env["NCCL_P2P_NET_CHUNKSIZE"] = P2P_CHUNK  # pipeline stages on different nodes
    return env


def apply(env: MutableMapping[str, str], cfg, nnodes: int = 1) -> MutableMapping[str, str]:
    """Set gpu_env(cfg) into `env` where the user did not set a value; record what ftcore chose."""
    auto = {k for k in env.get(AUTO, "").split(",") if k}
    chosen = gpu_env(cfg, nnodes)
    for k in auto - chosen.keys():  # an outer launcher's choice this config does not make
        env.pop(k, None)
    auto &= chosen.keys()
    for k, v in chosen.items():
        if k not in env or k in auto:
            env[k] = v
            auto.add(k)
    env[AUTO] = ",".join(sorted(auto))
    return env


def at_process_start(cfg, env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Apply gpu_env(cfg) to this process itself, whoever started it: the entry points call it
    first, before CUDA or NCCL initialise (CUDA_DEVICE_MAX_CONNECTIONS is read when the CUDA
    context is created, PYTORCH_CUDA_ALLOC_CONF at the first allocation, TORCH_NCCL_* and NCCL_*
    when a communicator is made). A plain `torchrun -m ftcore.train` gets what ftcore's own
    launchers give their workers. Returns what it set (logged once, by rank 0); nothing on CPU."""
    import logging
    import os
    import sys

    env = os.environ if env is None else env
    if cfg.cluster.device == "cpu":
        return {}
    local = max(int(env.get("LOCAL_WORLD_SIZE", "1") or 1), 1)
    nnodes = int(env.get("SLURM_NNODES") or max(int(env.get("WORLD_SIZE", "1")) // local, 1))
    before = dict(env)
    apply(env, cfg, nnodes)
    changed = {k: env[k] for k in gpu_env(cfg, nnodes) if before.get(k) != env.get(k)}
    log = logging.getLogger("ftcore")
    torch = sys.modules.get("torch")
    if changed and torch is not None and torch.cuda.is_initialized():
        log.warning("the GPU environment was set after CUDA initialised; some of %s take no "
                    "effect in this process", ", ".join(sorted(changed)))  # fmt: skip
    if changed and env.get("RANK", env.get("SLURM_PROCID", "0")) == "0":
        log.info("GPU environment: %s", " ".join(f"{k}={v}" for k, v in sorted(changed.items())))
    return changed
