"""Hydra multirun sweeps on SLURM through hydra-submitit-launcher (optional: `pip install
hydra-submitit-launcher`):

    python -m ftcore.launch.sweep -m hydra/launcher=submitit_slurm \\
        hydra.launcher.nodes=2 hydra.launcher.gpus_per_node=8 hydra.launcher.timeout_min=240 \\
        +exp=70b_lora parallel.tp=2,4,8

Each point of the sweep becomes one SLURM job (submitit submits them as an array) with one task
per node (keep `hydra.launcher.tasks_per_node=1`); that task runs ftcore's per-node launcher,
exactly as `slurm/*.sh` does, so the rendezvous, the allocation check and the workers are the same.
Each run's `run.dir` is the sweep job's own directory (`multirun/<date>/<time>/<n>`) unless set.
A sweep point is not requeued: a failed or stopped (exit 3) point raises, and submitit reports it.
Without `-m` the same command runs one configuration here, through the local launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from ftcore.config.schema import FtcoreConfig


def launcher_command(overrides: list[str], run_dir: str) -> list[str]:
    """The per-node launcher for this sweep point: its overrides, plus run.dir unless given."""
    if not any(o.split("=", 1)[0].lstrip("+") == "run.dir" for o in overrides):
        overrides = [*overrides, f"run.dir={run_dir}"]
    module = os.environ.get("FTCORE_MODULE", "ftcore.train")
    return [sys.executable, "-m", "ftcore.launch.node", "--module", module, "--", *overrides]


def run_point(cfg: DictConfig) -> int:
    hc = HydraConfig.get()
    cmd = launcher_command(list(hc.overrides.task), hc.runtime.output_dir)
    status = subprocess.call(cmd)
    if status != 0:
        raise RuntimeError(
            f"sweep point {list(hc.overrides.task)} exited {status}: {' '.join(cmd)}"
        )
    return status


ConfigStore.instance().store(name="ftcore_schema", node=FtcoreConfig)
main = hydra.main(config_path="pkg://ftcore.conf", config_name="config", version_base="1.3")(
    run_point
)

if __name__ == "__main__":
    main()
