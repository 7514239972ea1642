"""`logger.wandb.mode=offline` with the real wandb package: the run's history holds the numbers of
metrics.jsonl, and a resumed run continues the same wandb run id.

`tiny_lora` on 1 process: the first start stops after step 1 (the stop file: a checkpoint, exit 3),
the second resumes and trains steps 2-3 with an eval at step 2. The second start finds no
`<run.dir>/wandb_id` (deleted here), so the id must come back from the checkpoint. The `.wandb`
transaction logs are read back with wandb's own reader (`wandb leet inspect --json`, wandb-core).
No network: offline mode, and any URL wandb might try points at a closed local port; its logs must
not mention it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens; any request fails at once


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=str(tmp / "wandb_dir"),
        WANDB_CONFIG_DIR=str(tmp / "wandb_config"),
        WANDB_CACHE_DIR=str(tmp / "wandb_cache"),
        WANDB_DATA_DIR=str(tmp / "wandb_data"),
        WANDB_BASE_URL=DEAD,
        WANDB_DISABLE_GIT="true",
        HTTP_PROXY=DEAD,
        HTTPS_PROXY=DEAD,
        NO_PROXY="",
    )
    return env


def _train(run_dir: Path, env: dict) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ftcore.train", "+exp=tiny_lora", f"run.dir={run_dir}",
           "logger.wandb.mode=offline", "logger.progress=plain", "train.max_steps=3",
           "train.global_batch_size=4", "sched.warmup_steps=1", "checkpoint.interval=0",
           "checkpoint.async_save=false", "eval.accuracy=false", "eval.interval=2", "eval.iters=1"]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)


def _records(wandb_file: Path, env: dict) -> list[dict]:
    exe = Path(sys.executable).with_name("wandb")
    out = subprocess.run([str(exe), "leet", "inspect", "--json", str(wandb_file)], env=env,
                         capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_offline_history_and_resumed_id(tmp_path):
    env, run_dir = _env(tmp_path), tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "STOP").touch()  # stop (checkpoint, exit 3) after the first step
    first = _train(run_dir, env)
    assert first.returncode == 3, first.stderr[-3000:]
    run_id = (run_dir / "wandb_id").read_text().strip()
    (run_dir / "wandb_id").unlink()  # the resumed start must take the id from the checkpoint
    second = _train(run_dir, env)
    assert second.returncode == 0, second.stderr[-3000:]
    assert (run_dir / "wandb_id").read_text().strip() == run_id

    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2, files
    history: dict[int, dict] = {}
    for i, f in enumerate(files):
        recs = _records(f, env)
        (run,) = [r["run"] for r in recs if r["type"] == "run"]
        assert run["run_id"] == run_id
        steps = []
        for r in recs:
            if r["type"] == "history":
                step = r["history"]["step"]["num"]
                steps.append(step)
                history[step] = r["history"]["item"]
        assert steps == ([1] if i == 0 else [2, 3]), steps  # the resumed run continues at step 2
        (exit_code,) = [r["exit"]["exit_code"] for r in recs if r["type"] == "exit"]
        assert exit_code == (3 if i == 0 else 0)  # stopped for a requeue, then finished

    want: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        want.setdefault(rec.pop("step"), {}).update(rec)
    assert sorted(want) == sorted(history) == [1, 2, 3]
    assert "eval_loss" in want[2]
    for step, rec in want.items():
        got = {k: history[step][k] for k in rec}
        assert got == rec, (step, got, rec)

    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "127.0.0.1:9" not in logs, "wandb tried to reach the network"


def test_fresh_start_is_a_new_wandb_run(tmp_path, monkeypatch):
    """A run starting at step 0 in a directory that holds an old wandb_id (checkpoint.resume=never,
    or a crash before the first checkpoint) starts a new wandb run, as its metrics.jsonl starts
    anew; a resumed one (start step > 0) continues the id."""
    from ftcore.config.schema import compose
    from ftcore.training.metrics import MetricsWriter

    for k, v in _env(tmp_path).items():
        monkeypatch.setenv(k, v)
    cfg = compose(["logger.wandb.mode=offline", "logger.progress=plain"])
    run_dir = tmp_path / "run"
    ids = []
    for start in (0, 0, 1):
        w = MetricsWriter(cfg, run_dir, enabled=True, total_steps=3, start_step=start)
        try:
            try:
                w.write({"step": start + 1, "eval_loss": 1.5})
                if len(ids) == 1:
                    raise RuntimeError("a crash in the middle of the second run")
            finally:
                w.close()  # as trainer.fit does
        except RuntimeError:
            pass
        ids.append((run_dir / "wandb_id").read_text().strip())
    assert ids[0] != ids[1] and ids[2] == ids[1], ids
    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert sorted(f.name for f in files) == sorted(
        [f"run-{ids[0]}.wandb"] + [f"run-{ids[1]}.wandb"] * 2
    )
    # the crashed run is marked failed (exit code 1), not finished
    exits = [
        r["exit"]["exit_code"]
        for f in files
        for r in _records(f, _env(tmp_path))
        if r["type"] == "exit"
    ]
    assert sorted(exits) == [0, 0, 1], exits


def test_the_step_line_shows_dpo_and_moe_fields_and_a_collapsed_router(tmp_path, caplog):
    """Issue 52, item 13: DPO's reward accuracy and margin, MoE's aux_loss and expert load on the
    console step line; a warning, once, when expert_load_max_over_mean reaches num_experts / top-k
    (every token to the same experts: 8 experts, top-2 -> 4.0)."""
    import logging

    from ftcore.config.schema import compose
    from ftcore.training.metrics import MetricsWriter

    cfg = compose(["model.num_experts=8", "model.moe_router_topk=2", "logger.progress=lines"])
    base = {"loss": 0.5, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 10.0, "step_time_s": 0.1}
    w = MetricsWriter(cfg, tmp_path, enabled=True, total_steps=4, start_step=0)
    with caplog.at_level(logging.INFO, logger="ftcore"):
        w.write({"step": 1, **base, "rewards/accuracies": 0.75, "rewards/margins": 0.0123})
        w.write({"step": 2, **base, "aux_loss": 0.0123, "expert_load_max_over_mean": 1.5})
        for step in (3, 4):
            w.write({"step": step, **base, "aux_loss": 0.01, "expert_load_max_over_mean": 4.0})
    w.close()
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].endswith("| acc 0.750 | margin 0.0123"), lines
    assert lines[1].endswith("| aux_loss 0.0123 | expert load 1.50"), lines
    collapsed = [ln for ln in lines if "the router collapsed" in ln]
    assert len(collapsed) == 1 and collapsed[0].startswith("step 3: expert_load_max_over_mean 4.00")
