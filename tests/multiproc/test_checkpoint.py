"""Checkpoint files: every tensor comes back, atomic publish, keep, corruption is named.

Two gloo ranks (the session pool), the tiny model, synthetic layout-independent batches."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state as ps
from torch.distributed.checkpoint import FileSystemReader

from ftcore.checkpoint import resume, store
from ftcore.errors import FtcoreError
from tests.support.ckpt_cases import build_resumed, latest, local_tensors, train


def roundtrip(overrides: list[str], run_dir: str) -> dict:
    """Train 2 steps, save, then build the run afresh (auto resume) and compare everything."""
    state = build_resumed(overrides + ["checkpoint.keep=0"], run_dir)
    train(state, 2)
    wandb_id = Path(run_dir) / "wandb_id"  # what metrics.py keeps for a wandb run
    if state.info.rank == 0:
        wandb_id.write_text("run-abc123")
    store.save(state)
    if state.info.rank == 0:
        wandb_id.unlink()  # e.g. a resume=PATH into a fresh run.dir
    before = local_tensors(state)
    rng_before = resume.rng_state()
    loader_before = state.loader.state_dict()
    sched_before = state.scheduler.state_dict()
    state2 = build_resumed(overrides, run_dir)
    after = local_tensors(state2)
    rng_after = resume.rng_state()
    mismatched = [k for k in before if k not in after or not torch.equal(before[k], after[k])]
    return {
        "n": len(before),
        "mismatched": mismatched + [k for k in after if k not in before],
        "step": state2.step,
        "consumed": state2.consumed_samples,
        "loader": state2.loader.state_dict() == loader_before,
        "sched": state2.scheduler.state_dict() == sched_before,
        "rng": torch.equal(rng_before["torch"], rng_after["torch"])
        and rng_before["python"] == rng_after["python"]
        and all(
            torch.equal(rng_before["tracker"][k], rng_after["tracker"][k])
            for k in rng_before["tracker"]
        ),
        "dp_rank": ps.get_data_parallel_rank(),
        "wandb_id": wandb_id.read_text() if wandb_id.exists() else None,
    }


@pytest.mark.dist
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2"],
        ["parallel.pp=2"],
        ["parallel.distributed_optimizer=true"],
        ["peft=lora", "parallel.tp=2", "peft.target_modules=[q_proj,v_proj,o_proj,down_proj]"],
    ],
    ids=["tp2", "pp2", "dp2_distopt", "tp2_lora"],
)
def test_every_tensor_comes_back(pool2, tmp_path, layout):
    """Every tensor of every rank (adapter shards of every TP rank included: MB #2252), the
    optimizer moments, schedule, data position and RNG states come back bit for bit."""
    results = pool2.run(roundtrip, layout, str(tmp_path))
    for r in results:
        assert r["n"] > 0 and not r["mismatched"], r["mismatched"][:5]
        assert r["step"] == 2 and r["consumed"] == 16
        assert r["loader"] and r["sched"] and r["rng"]
    assert results[0]["wandb_id"] == "run-abc123"  # the resumed run continues the same wandb run
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_2"
    manifest = json.loads((root / "step_2" / "manifest.json").read_text())
    assert manifest["step"] == 2 and "common.pt" in manifest["files"]
    assert (root / "step_2" / "config.yaml").is_file()
    assert not [p for p in root.iterdir() if p.name.startswith(".")]
    keys = set(FileSystemReader(str(root / "step_2")).read_metadata().state_dict_metadata)
    if "peft=lora" in layout:  # adapter-only: the frozen base comes back from the model itself
        tensors = {k for k in keys if "_extra_state" not in k}
        assert tensors and all("lora" in k for k in tensors), sorted(tensors)[:5]
    else:
        assert "embedding.word_embeddings.weight" in keys


def keep_case(run_dir: str) -> list[str]:
    state = build_resumed(["parallel.tp=2", "checkpoint.keep=2"], run_dir)
    train(state, 4, save_every=1)
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


@pytest.mark.dist
def test_keep_last_n(pool2, tmp_path):
    (tmp_path / "checkpoints" / ".tmp_step_9").mkdir(parents=True)  # an earlier crashed save
    names = pool2.run(keep_case, str(tmp_path))[0]
    assert names == ["latest", "step_3", "step_4"]


def save_case(run_dir: str) -> None:
    state = build_resumed(["parallel.tp=2"], run_dir)
    train(state, 1)
    store.save(state)


def load_case(run_dir: str) -> str:
    try:
        build_resumed(["parallel.tp=2"], run_dir)
    except FtcoreError as e:
        return str(e)
    return "loaded"


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # flip one byte in the middle, same size
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :])


@pytest.fixture(scope="module")
def saved(pool2, tmp_path_factory) -> Path:
    """One TP=2 run directory with step_1 saved; each test damages its own copy."""
    run_dir = tmp_path_factory.mktemp("saved")
    pool2.run(save_case, str(run_dir))
    return run_dir


@pytest.mark.dist
@pytest.mark.parametrize("how", ["truncate", "flip"])
def test_corrupt_file_is_named(pool2, saved, tmp_path, how):
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    step = tmp_path / "checkpoints" / "step_1"
    victims = sorted(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    victim = victims[-1]
    _damage(victim, how)
    msgs = pool2.run(load_case, str(tmp_path))
    for m in msgs:
        assert str(victim) in m and "corrupt" in m, m


@pytest.mark.dist
def test_missing_manifest_is_refused(pool2, saved, tmp_path):
    """A published directory without its manifest never loads as if it were whole."""
    shutil.copytree(saved, tmp_path, dirs_exist_ok=True)
    os.remove(tmp_path / "checkpoints" / "step_1" / "manifest.json")
    for m in pool2.run(load_case, str(tmp_path)):
        assert "manifest.json is missing" in m, m


def async_case(run_dir: str) -> dict:
    """The GPU path (background write, publish at a later step boundary) forced on CPU: megatron's
    forked writer with a fork-context results queue, in a worker allowed to fork."""
    import multiprocessing as mp

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    proc = mp.current_process()
    daemon, queue_before, use_async = (
        proc._config.get("daemon"),
        filesystem_async._results_queue,
        store._use_async,
    )
    proc._config["daemon"] = False
    filesystem_async._results_queue = mp.get_context("fork").Queue()
    store._use_async = lambda state: True
    try:
        state = build_resumed(["parallel.tp=2"], run_dir)
        train(state, 1)
        store.save(state)
        pending = store.exists(state, 1)
        train(state, 1)
        store.poll(state)
        store.save(state, blocking=True)  # publishes step_1 first, then step_2
        published = latest(Path(run_dir))
        before = local_tensors(state)
    finally:
        proc._config["daemon"] = daemon
        filesystem_async._results_queue = queue_before
        store._use_async = use_async
    state2 = build_resumed(["parallel.tp=2"], run_dir)
    after = local_tensors(state2)
    return {"pending": pending, "published": published, "step": state2.step,
            "same": all(torch.equal(before[k], after[k]) for k in before)}  # fmt: skip


@pytest.mark.dist
def test_async_save_publishes_in_order(pool2, tmp_path):
    for r in pool2.run(async_case, str(tmp_path)):
        assert r == {"pending": True, "published": "step_2", "step": 2, "same": True}, r
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "latest",
        "step_1",
        "step_2",
    ]


def never_case(run_dir: str) -> None:
    """resume=never in a run.dir holding an older run's step_1 and step_2 (seed 7)."""
    old = build_resumed(["parallel.tp=2", "run.seed=7"], run_dir)
    train(old, 2, save_every=1)
    state = build_resumed(["parallel.tp=2"], run_dir, resume="never")
    train(state, 1)
    store.save(state)


@pytest.mark.dist
def test_resume_never_overwrites_an_older_run(pool2, tmp_path):
    from omegaconf import OmegaConf

    pool2.run(never_case, str(tmp_path))
    assert latest(tmp_path) == "step_1"
    assert OmegaConf.load(tmp_path / "checkpoints" / "step_1" / "config.yaml").run.seed == 1234
