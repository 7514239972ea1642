"""Stop requests: a signal to one rank, the stop file, run.max_time -> every rank saves the same
step at the next step boundary and raises StopRequested (exit 3); handlers exist only while
fit() runs, and not at all with run.handle_signals=false.

The gloo pool for the cases; the same with real processes (a signal to one trainer rank, Ctrl-C to
ftcore's own launcher) is in test_resume_kill.py, next to its reference run; Ctrl-C to one process
and the resume command it prints, below."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ftcore.errors import StopRequested
from ftcore.training import trainer
from tests.support.ckpt_cases import (
    ROOT,
    build_resumed,
    last_step,
    latest,
    metric_lines,
    same_metrics,
)
from tests.support.cli import LAUNCHER_ENV


def fit_until_stop(overrides: list[str], run_dir: str, signal_rank1_at: int = 0) -> dict:
    """fit(); rank 1 sends itself SIGUSR1 while fetching the batch of step `signal_rank1_at`."""
    import torch.distributed as dist

    state = build_resumed(overrides, run_dir)
    if signal_rank1_at and dist.get_rank() == 1:
        inner = state.loader.next_microbatches

        def next_microbatches():
            if state.step + 1 == signal_rank1_at:
                os.kill(os.getpid(), signal.SIGUSR1)
            return inner()

        state.loader.next_microbatches = next_microbatches
    before = signal.getsignal(signal.SIGUSR1)
    try:
        trainer.fit(state)
        stopped = None
    except StopRequested as e:
        stopped = (e.step, e.reason)
    return {
        "stopped": stopped,
        "step": state.step,
        "restored": signal.getsignal(signal.SIGUSR1) == before,
    }


POOL = ["train.max_steps=4", "checkpoint.keep=0"]


@pytest.mark.dist
def test_signal_to_one_rank_stops_all(pool2, tmp_path):
    res = pool2.run(fit_until_stop, POOL, str(tmp_path), signal_rank1_at=2)
    assert [r["stopped"][0] for r in res] == [2, 2], res
    assert "SIGUSR1" in res[1]["stopped"][1]
    assert all(r["restored"] for r in res)  # handlers released after fit()
    assert latest(tmp_path) == "step_2"


@pytest.mark.dist
def test_stop_file_and_max_time(pool2, tmp_path):
    (tmp_path / "STOP").write_text("")
    res = pool2.run(fit_until_stop, POOL, str(tmp_path))
    assert [r["stopped"][0] for r in res] == [1, 1] and "stop file" in res[0]["stopped"][1]
    assert latest(tmp_path) == "step_1" and not (tmp_path / "STOP").exists()  # consumed
    res = pool2.run(fit_until_stop, POOL + ["run.max_time=0.000001"], str(tmp_path))
    assert [r["stopped"] for r in res] == [(2, "run.max_time")] * 2
    assert latest(tmp_path) == "step_2"
    res = pool2.run(fit_until_stop, POOL, str(tmp_path))  # the rest of the run
    assert [r["stopped"] for r in res] == [None, None] and res[0]["step"] == 4
    assert [r["step"] for r in metric_lines(tmp_path)] == [1, 2, 3, 4]


_HANDLERS = """
import os, signal, sys, time
from types import SimpleNamespace as NS
from ftcore.runtime import signals
cfg = NS(run=NS(handle_signals=sys.argv[1] == "1", stop_file=None, max_time=None))
signals.install(cfg)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("survived SIGTERM, flagged:", signals._received, flush=True)
signals.uninstall()
print("default restored:", signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(2)
print("still alive", flush=True)
"""


@pytest.mark.parametrize("enabled", [True, False])
def test_handlers_only_when_enabled_and_released(enabled):
    out = subprocess.run([sys.executable, "-c", _HANDLERS, "1" if enabled else "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == -signal.SIGTERM, out.stderr[-2000:]
    if enabled:
        assert "flagged: ['SIGTERM']" in out.stdout and "default restored: True" in out.stdout
    else:
        assert out.stdout == ""
    assert "still alive" not in out.stdout


# One process, as a user runs it: Ctrl-C mid-run saves, exits 3 and prints the command that
# resumes; that command ends with the uninterrupted run's metrics and adapter, to the last bit.
_CTRL_C = [
    "+exp=tiny_lora",
    "train.max_steps=5",
    "eval.accuracy=false",
    "checkpoint.interval=0",
    "data.seq_len=64",
]  # fmt: skip (eval.interval=50: longer than the run)


def _train(*argv: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    env["FTCORE_LOG_LEVEL"] = "INFO"  # start_new_session: a terminal's Ctrl-C reaches the group
    return subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_lora_run(tmp_path_factory) -> Path:
    """The uninterrupted run (checkpoint and adapter at its end), shared by the tests below."""
    ref = tmp_path_factory.mktemp("tiny_lora") / "ref"
    proc = _train("-m", "ftcore.train", *_CTRL_C, f"run.dir={ref}")
    out = proc.communicate(timeout=400)[0]
    assert proc.returncode == 0, out[-3000:]
    # a run shorter than eval.interval still evaluates its held-out data, at its end
    evals = [json.loads(ln) for ln in (ref / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in evals if "eval_loss" in r] == [5]
    assert "validation loss: final" in out, out[-3000:]
    return ref


@pytest.mark.slow
def test_ctrl_c_saves_and_the_printed_command_resumes(tiny_lora_run, tmp_path):
    run_dir = tmp_path / "run"
    proc = _train("-m", "ftcore.train", *_CTRL_C, f"run.dir={run_dir}")
    end = time.time() + 300
    while last_step(run_dir) < 2:
        assert proc.poll() is None and time.time() < end, proc.stdout.read()[-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 3, out[-3000:]
    stopped = last_step(run_dir)
    assert stopped < 5 and latest(run_dir) == f"step_{stopped}", out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    (line,) = [ln for ln in out.splitlines() if "resume with: " in ln]
    cmd = shlex.split(line.split("resume with: ", 1)[1])
    assert cmd[:3] == ["python", "-m", "ftcore.train"] and cmd[-1] == f"run.dir={run_dir}", cmd
    resumed = _train(*cmd[1:])
    out = resumed.communicate(timeout=400)[0]
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{stopped}'}" in out, out[-3000:]
    assert "Warning" not in out, out[-3000:]  # torch's/megatron's deprecations on load: quiet
    same_metrics(run_dir, tiny_lora_run)
    adapter = "hf_adapter/adapter_model.safetensors"
    assert (run_dir / adapter).read_bytes() == (tiny_lora_run / adapter).read_bytes()


def _tree(d: Path) -> dict[str, bytes]:
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}


@pytest.mark.slow
@pytest.mark.parametrize(
    "change, says",
    [
        (["model.num_layers=3"], "saved for another model"),  # the checkpoint's own check
        (["peft=none"], "is an adapter-only (PEFT) checkpoint"),  # PEFT mode
        (["peft.r=8"], "adapters of another shape (peft.r: 16 -> 8)"),  # loaded a slice before
    ],
)
def test_a_refused_resume_writes_nothing(tiny_lora_run, tmp_path, change, says):
    """Exit 2 and the run directory as it was, byte for byte (config.yaml keeps matching the
    checkpoints it sits beside)."""
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_lora_run, run_dir)
    before = _tree(run_dir)
    proc = _train("-m", "ftcore.train", *_CTRL_C, *change, f"run.dir={run_dir}")
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 2 and says in out, out[-3000:]
    assert _tree(run_dir) == before


# Issue 52, item 2: a resume given settings that differ from its checkpoint's applies them, or
# refuses with exit 2; it never keeps the checkpoint's value. The checkpoint: tiny_lora_run's
# step 5 (optim.lr 3e-3, sched.warmup_steps 10 scaled to the run's 5 steps).


def _resume(tiny_lora_run, tmp_path, *change: str) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path / "run"
    shutil.copytree(tiny_lora_run, run_dir)
    proc = _train("-m", "ftcore.train", *_CTRL_C, *change, f"run.dir={run_dir}")
    out = proc.communicate(timeout=300)[0]
    return run_dir, subprocess.CompletedProcess(proc.args, proc.returncode, out)


@pytest.fixture(scope="module")
def new_lr_and_steps(tiny_lora_run, tmp_path_factory) -> tuple[dict, str]:
    """tiny_lora_run's step 5 resumed with optim.lr=1e-3 and train.max_steps=7 (one run for the
    two tests below): the schedule rebuilt from both at step 5 makes step k train at
    1e-3 * k / 7 (the warm-up scaled to the 7 steps); the checkpoint's kept the old schedule
    (3e-3 over 5 steps) and trained steps 6 and 7 at sched.min_lr, 3e-4."""
    run_dir, p = _resume(tiny_lora_run, tmp_path_factory.mktemp("resumed"), "train.max_steps=7",
                         "optim.lr=1e-3")  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:]
    return {r["step"]: r["lr"] for r in metric_lines(run_dir)}, p.stdout


@pytest.mark.slow
def test_a_resume_applies_a_changed_lr(new_lr_and_steps):
    lrs, out = new_lr_and_steps
    assert "optim.lr 0.003 -> 0.001" in out, out[-3000:]
    assert lrs[7] == pytest.approx(1e-3, abs=1e-8), lrs  # the new peak, reached at the new end


@pytest.mark.slow
def test_a_resume_applies_a_changed_max_steps(new_lr_and_steps):
    lrs, out = new_lr_and_steps
    assert "train.max_steps 5 -> 7" in out, out[-3000:]
    assert sorted(lrs) == list(range(1, 8))
    assert lrs[6] / lrs[7] == pytest.approx(6 / 7, rel=1e-4), (
        lrs
    )  # the 7-step schedule's shape (8 digits)


@pytest.mark.slow
def test_a_resume_with_another_data_path_is_refused_or_continues_when_allowed(
    tiny_lora_run, tmp_path
):
    """Another data.path: exit 2 naming it and both fixes, the run directory untouched; with
    checkpoint.allow_changed=[data.path] the run goes on, the new data read from its start."""
    other = str(ROOT / "ftcore" / "assets" / "data" / "val.jsonl")
    run_dir, p = _resume(tiny_lora_run, tmp_path, "train.max_steps=6", f"data.path={other}")
    assert p.returncode == 2, p.stdout[-3000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.startswith("ftcore error:")]
    assert line.startswith("ftcore error: data.path: ") and other in line, line
    # the preset holds out 10% of the user's data (ftcore/config/presets.py): a change too
    allow = re.search(r"'(checkpoint\.allow_changed=\[data\.path,data\.val_fraction\])'", line)
    assert "a new run.dir" in line and allow, line
    assert _tree(run_dir) == _tree(tiny_lora_run)
    shutil.rmtree(run_dir)
    run_dir, p = _resume(tiny_lora_run, tmp_path, "train.max_steps=6", f"data.path={other}",
                         allow.group(1))  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:]
    assert "the data is read from its beginning" in p.stdout, p.stdout[-3000:]
    assert [r["step"] for r in metric_lines(run_dir)] == [1, 2, 3, 4, 5, 6]
