"""`python -m ftcore.train +exp=NAME [overrides]`: under torchrun/srun, or alone (then it starts
`launcher.nproc_per_node` local workers itself)."""

from __future__ import annotations

from omegaconf import DictConfig

from ftcore.cli import run


def task(cfg: DictConfig) -> int | None:
    from ftcore.runtime import gpu_env
    from ftcore.validation import checks, preflight

    gpu_env.at_process_start(cfg)  # before CUDA/NCCL initialise, whoever started this process
    # first: on a machine without a GPU nothing else matters
    preflight.require_cuda(cfg, "train")
    preflight.use_adapter(cfg, training=True)
    from ftcore.runtime import dist

    status = dist.launch_standalone(cfg, "ftcore.train", checks.check_for_launch)
    if status is not None:
        return status
    from ftcore.runtime import run_lock
    from ftcore.training import trainer

    try:
        state = trainer.setup(cfg)
        trainer.fit(state)
    finally:
        dist.teardown()
        run_lock.release()  # the lock rank 0 took in setup, if any
    return None


if __name__ == "__main__":
    run("train", task)
