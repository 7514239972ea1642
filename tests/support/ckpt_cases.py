"""Worker-side helpers for the checkpoint/resume tests (run inside the gloo pool)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from ftcore.checkpoint import store
from ftcore.models.sharding import iter_params
from ftcore.training import trainer
from tests.support.cli import LAUNCHER_ENV
from tests.support.layouts import build
from tests.support.rendezvous import host_store, rank_env
from tests.support.tiny import TINY

ROOT = Path(__file__).resolve().parents[2]


def build_resumed(overrides: list[str], run_dir: str, resume: str = "auto"):
    """A run with the synthetic loader attached *before* resuming, as the trainer's own loader is
    (layouts.build attaches it after setup, which would leave the data position unrestored)."""
    state = build(list(overrides) + ["checkpoint.resume=never"], run_dir)
    state.cfg.checkpoint.resume = resume
    store.maybe_resume(state)
    return state


def train(state, steps: int, save_every: int = 0) -> list[float]:
    losses = []
    for _ in range(steps):
        out = trainer.train_step(state)
        assert not out.get("skipped")
        state.step += 1
        losses.append(out["loss"])
        if save_every and state.step % save_every == 0:
            store.save(state)
    return losses


def local_tensors(state) -> dict[str, torch.Tensor]:
    """This rank's parameter shards and their Adam moments (same layout: shards compare 1:1)."""
    out = {}
    opt = state.optimizer
    inner = [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    for name, p in iter_params(state.model):
        out[name] = p.detach().clone()
        for o in inner:
            for k, v in o.state.get(p, {}).items():
                out[f"{name}/{k}"] = torch.as_tensor(v).clone()
    return out


# --- real processes: two ranks started the way srun/torchrun start them ---------------------------

E2E = [
    "train.max_steps=12",
    "checkpoint.keep=0",
    "checkpoint.save_at_end=true",
    "launcher.threads_per_rank=1",
]


class Workers:
    """`python -m ftcore.train` as 2 ranks (RANK/WORLD_SIZE/MASTER_* set, as srun or torchrun
    would), or through ftcore's own local launcher (`launcher=True`: one parent, 2 workers; with
    `command`, that command line as given, e.g. one ftcore printed)."""

    def __init__(self, run_dir: Path, overrides: list[str], log: Path, *, launcher: bool = False,
                 command: list[str] | None = None):  # fmt: skip
        self.run_dir, self.log_path = Path(run_dir), log
        argv = [
            sys.executable,
            "-u",
            "-m",
            "ftcore.train",
            *TINY,
            *E2E,
            *overrides,
            f"run.dir={run_dir}",
        ]
        base = dict(os.environ, FTCORE_LOG_LEVEL="INFO", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        for k in LAUNCHER_ENV:
            base.pop(k, None)
        self.env = base  # what a user's shell would hand the next start
        self.log = open(log, "a")  # noqa: SIM115 - closed in wait()
        self.t0 = time.time()
        if launcher:  # its own process group, as a shell starts a command (os.killpg kills it)
            self.argv = command or argv + ["launcher.nproc_per_node=2"]
            self.procs = [subprocess.Popen(self.argv, env=base, cwd=ROOT,
                                           stdout=self.log, stderr=subprocess.STDOUT,
                                           start_new_session=True)]  # fmt: skip
            return
        self.store = host_store(2)  # open until these ranks are gone
        self.procs = []
        for rank in range(2):
            env = dict(base, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                       **rank_env(self.store))  # fmt: skip
            self.procs.append(
                subprocess.Popen(argv, env=env, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
            )

    def signal(self, sig: int, ranks=(0, 1)) -> None:
        for r in ranks:
            self.procs[r].send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL, range(len(self.procs)))
        for p in self.procs:  # 60 s from now (wait() counts from the start: minutes ago when busy)
            p.wait(timeout=60)
        self.log.close()

    def wait(self, timeout: float = 400) -> list[int]:
        try:
            codes = [p.wait(timeout=max(1.0, self.t0 + timeout - time.time())) for p in self.procs]
        except subprocess.TimeoutExpired:
            for p in self.procs:
                p.kill()
            raise AssertionError(
                f"workers still running after {timeout} s:\n{self.text()[-3000:]}"
            ) from None
        self.log.close()
        return codes

    def until(self, predicate, timeout: float = 300, poll: float = 0.002) -> None:
        """Poll (fast: saves and steps take a fraction of a second) until predicate() holds."""
        end = time.time() + timeout
        while not predicate():
            if any(p.poll() is not None for p in self.procs):
                raise AssertionError(f"a worker exited early:\n{self.text()[-3000:]}")
            if time.time() > end:
                raise AssertionError(f"timed out waiting:\n{self.text()[-3000:]}")
            time.sleep(poll)

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()


def latest(run_dir: Path) -> str | None:
    try:
        return (Path(run_dir) / "checkpoints" / "latest").read_text().strip()
    except FileNotFoundError:
        return None


def metric_lines(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return [r for r in out if "loss" in r]


def last_step(run_dir: Path) -> int:
    lines = metric_lines(run_dir)
    return lines[-1]["step"] if lines else 0


DETERMINISTIC = ("step", "loss", "lr", "grad_norm", "tokens", "target_tokens")


def same_metrics(got_dir: Path, ref_dir: Path) -> None:
    """Steps 1..N each exactly once, and the deterministic fields equal to the last bit."""
    got = [{k: r[k] for k in DETERMINISTIC} for r in metric_lines(got_dir)]
    ref = [{k: r[k] for k in DETERMINISTIC} for r in metric_lines(ref_dir)]
    assert [r["step"] for r in got] == list(range(1, len(ref) + 1)), [r["step"] for r in got]
    for g, r in zip(got, ref):
        assert g == r, (g, r)


def same_final_weights(got_dir: Path, ref_dir: Path) -> None:
    from safetensors.torch import load_file

    def load(d):
        out = {}
        for f in sorted((Path(d) / "hf_model").glob("*.safetensors")):
            out.update(load_file(f))
        return out

    got, ref = load(got_dir), load(ref_dir)
    assert got.keys() == ref.keys() and got
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
