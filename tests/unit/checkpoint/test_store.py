"""Which checkpoint a start resumes from: only what `latest` names; unfinished saves and
unpublished newer directories are reported and never loaded (MB #5746, #5964)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from ftcore.checkpoint import files, store
from ftcore.errors import FtcoreError


def _state(run_dir: Path, resume: str = "auto"):
    return NS(cfg=NS(checkpoint=NS(resume=resume)), run_dir=run_dir, info=NS(rank=0), extra={})


def _complete(root: Path, step: int) -> Path:
    d = root / f"step_{step}"
    d.mkdir(parents=True)
    (d / "common.pt").write_bytes(b"x" * 10)
    (d / "manifest.json").write_text(json.dumps({"step": step, "files": {"common.pt": [10, 0]}}))
    return d


def test_only_latest_is_trusted(tmp_path, caplog):
    root = tmp_path / "checkpoints"
    _complete(root, 3)
    _complete(root, 7)  # renamed but never published
    (root / ".tmp_step_9").mkdir()  # a save that was killed
    (root / "step_8").mkdir()  # a directory without manifest
    (root / "latest").write_text("step_3\n")
    with caplog.at_level(logging.WARNING, logger="ftcore"):
        assert store.resolve(_state(tmp_path)) == root / "step_3"
    text = caplog.text
    assert "ignoring incomplete checkpoint" in text and ".tmp_step_9" in text and "step_8" in text
    assert "ignoring unpublished checkpoint" in text and "step_7" in text


def test_first_save_killed_starts_fresh_and_says_so(tmp_path, caplog):
    (tmp_path / "checkpoints" / ".tmp_step_5").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="ftcore"):
        assert store.resolve(_state(tmp_path)) is None
    assert ".tmp_step_5" in caplog.text


def test_dangling_latest_and_bad_paths(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    (root / "latest").write_text("step_4\n")
    with pytest.raises(FtcoreError, match="step_4, which does not exist"):
        store.resolve(_state(tmp_path))
    with pytest.raises(FtcoreError, match="no checkpoint directory"):
        store.resolve(_state(tmp_path, str(tmp_path / "nope")))
    assert store.resolve(_state(tmp_path, "never")) is None


def test_manifest_checks_name_the_file(tmp_path):
    d = _complete(tmp_path, 1)
    files.check_manifest(d, checksums=False)  # sizes match
    (d / "common.pt").write_bytes(b"x" * 4)
    with pytest.raises(FtcoreError, match=r"common\.pt is corrupt: 4 bytes, 10 written"):
        files.check_manifest(d, checksums=False)
    (d / "manifest.json").write_text("{not json")
    with pytest.raises(FtcoreError, match=r"manifest\.json is corrupt"):
        files.check_manifest(d, checksums=True)


def test_another_model_or_peft_mode_is_refused(tmp_path):
    from omegaconf import OmegaConf

    from ftcore.checkpoint import changes
    from ftcore.config.schema import compose
    from tests.support.tiny import TINY

    saved = compose(TINY)
    common = {"config": OmegaConf.to_yaml(saved), "adapter_only": False}
    state = NS(cfg=compose(TINY + ["model.hidden_size=128"]), info=NS(rank=0))
    with pytest.raises(FtcoreError, match=r"another model \(model.hidden_size: 64 -> 128\)"):
        changes.check_compatible(state, common, tmp_path)
    state = NS(cfg=compose(TINY + ["peft=lora"]), info=NS(rank=0))
    with pytest.raises(FtcoreError, match="a full checkpoint but this run has peft.name=lora"):
        changes.check_compatible(state, common, tmp_path)
    lora = {"config": OmegaConf.to_yaml(compose(TINY + ["peft=lora"])), "adapter_only": True}
    state = NS(cfg=compose(TINY + ["peft=lora", "peft.r=4"]), info=NS(rank=0))
    with pytest.raises(FtcoreError, match=r"adapters of another shape \(peft.r: 16 -> 4\)"):
        changes.check_compatible(state, lora, tmp_path)
    state = NS(cfg=compose(TINY + ["optim.lr=1e-4", "parallel.tp=2"]), info=NS(rank=0))
    changes.check_compatible(state, common, tmp_path)  # a changed lr or layout is fine


def test_a_changed_data_stream_is_refused_unless_allowed(tmp_path):
    """Issue 52, item 2: what decides the rows of the data stream (data.*, run.seed) refuses a
    resume with the keys and both fixes; `checkpoint.allow_changed` lets it through (the caller
    then reads the new data from its start); what does not (data.val_path) is simply applied."""
    from omegaconf import OmegaConf

    from ftcore.checkpoint import changes
    from ftcore.config.schema import compose
    from tests.support.tiny import TINY

    common = {"config": OmegaConf.to_yaml(compose(TINY)), "adapter_only": False, "step": 3}
    for change in (["data.path=chat.jsonl", "data.seq_len=48"], ["run.seed=7"]):
        state = NS(cfg=compose(TINY + change), info=NS(rank=0))
        with pytest.raises(FtcoreError) as e:
            changes.check_compatible(state, common, tmp_path)
        keys = [c.split("=")[0] for c in change]
        assert all(k in str(e.value) for k in keys), e.value
        assert (
            "a new run.dir" in e.value.fix
            and f"checkpoint.allow_changed=[{','.join(keys)}]" in e.value.fix
        )
        allowed = compose(TINY + change + [f"checkpoint.allow_changed=[{','.join(keys)}]"])
        assert changes.check_compatible(NS(cfg=allowed, info=NS(rank=0)), common, tmp_path) == keys
    state = NS(cfg=compose(TINY + ["data.val_path=val.jsonl"]), info=NS(rank=0))
    assert changes.check_compatible(state, common, tmp_path) == []
    state = NS(cfg=compose(TINY + ["train.max_steps=2"]), info=NS(rank=0))
    with pytest.raises(FtcoreError, match=r"train.max_steps=2 is below the step"):
        changes.check_compatible(state, common, tmp_path)
