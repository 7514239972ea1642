"""`python -m ftcore.train +exp=NAME [overrides]`: under torchrun/srun, or alone (then it starts
`launcher.nproc_per_node` local workers itself)."""

from __future__ import annotations

import copy
import sys

from omegaconf import DictConfig

from ftcore.cli import run


def task(cfg: DictConfig) -> int | None:
    from ftcore import trainer, validate
    from ftcore.runtime import dist

    if not dist.under_launcher() and cfg.launcher.nproc_per_node > 1:
        # Check the config once here (exit 2 before any worker starts), fix run.dir for all ranks.
        if cfg.model.hf_path:  # check the HF model's shapes, not the model group's
            from ftcore.hf.config import merge_hf_config

            validate.validate(merge_hf_config(copy.deepcopy(cfg)), cfg.launcher.nproc_per_node)
        else:
            validate.validate(cfg, cfg.launcher.nproc_per_node)
        argv = [a for a in sys.argv[1:] if not a.startswith("run.dir=")]
        argv.append(f"run.dir={trainer.decide_run_dir(cfg)}")
        return dist.launch_local_workers("ftcore.train", argv, cfg.launcher.nproc_per_node)
    try:
        state = trainer.setup(cfg)
        trainer.fit(state)
    finally:
        dist.teardown()
    return None


if __name__ == "__main__":
    run("train", task)
