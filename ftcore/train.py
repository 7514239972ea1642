"""`python -m ftcore.train +exp=NAME [overrides]`: under torchrun/srun, or alone (then it starts
`launcher.nproc_per_node` local workers itself)."""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from ftcore.cli import run


def task(cfg: DictConfig) -> int | None:
    from ftcore import validate
    from ftcore.runtime import dist

    if not dist.under_launcher():
        # Check the config before megatron is imported or any worker starts: bad input exits 2 fast.
        validate.check_for_launch(cfg, cfg.launcher.nproc_per_node)
        if cfg.launcher.nproc_per_node > 1:  # start the workers; run.dir is fixed for all ranks
            argv = [a for a in sys.argv[1:] if not a.startswith("run.dir=")]
            argv.append(f"run.dir={dist.decide_run_dir(cfg)}")
            return dist.launch_local_workers("ftcore.train", argv, cfg.launcher.nproc_per_node)
    from ftcore import trainer

    try:
        state = trainer.setup(cfg)
        trainer.fit(state)
    finally:
        dist.teardown()
    return None


if __name__ == "__main__":
    run("train", task)
