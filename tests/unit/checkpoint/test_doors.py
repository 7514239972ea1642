"""Issue 51: the attacks of the third red-team pass on checkpoints and run directories, replayed
on a real checkpoint of the tiny model (one process, saved once per module), each as its author
would plant it (manifest re-signed): refused with exit 2 (an FtcoreError) or harmless, nothing
written through a link, nothing deleted, no secret in any output."""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
import types
import zlib
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from ftcore.checkpoint import store
from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files
from tests.support.cli import cli, error_line
from tests.support.tiny import TINY

SECRET = "sk-ftcore-test-4242-do-not-print"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(run directory with checkpoints/step_1 and latest, the live one-process run)."""
    from ftcore.runtime import dist
    from tests.support.ckpt_cases import train
    from tests.support.layouts import build

    run_dir = tmp_path_factory.mktemp("doors") / "run"
    state = build(["checkpoint.resume=never", "launcher.threads_per_rank=1"], str(run_dir))
    train(state, 1)
    store.save(state)
    yield run_dir, state
    dist.teardown()


def _copy(saved, tmp_path: Path, name: str = "run") -> tuple[Path, Path]:
    run = tmp_path / name
    shutil.copytree(saved[0], run)
    return run, run / "checkpoints" / "step_1"


def _sign(step: Path, *names: str, drop: tuple[str, ...] = ()) -> None:
    """Update the manifest's sizes and CRC32s of `names` (and drop `drop`), as an author could."""
    manifest = json.loads((step / "manifest.json").read_text())
    for name in drop:
        manifest["files"].pop(name, None)
    for name in names:
        data = (step / name).read_bytes()
        manifest["files"][name] = [len(data), zlib.crc32(data)]
    (step / "manifest.json").write_text(json.dumps(manifest))


class _Payload:
    """What a crafted pickle runs when unpickled: it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


_payload = _Payload


# ---------------------------------------------------------------- 1: no interpolation is resolved


def _plant_secret(step: Path, key: str, value: str) -> None:
    cfg = step / "config.yaml"
    lines = cfg.read_text().splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.strip().startswith(f"{key}:"))
    lines[at] = lines[at].split(":")[0] + f": {value}"
    cfg.write_text("\n".join(lines) + "\n")
    _sign(step, "config.yaml")


def test_export_never_resolves_a_checkpoints_interpolation(saved, tmp_path, monkeypatch):
    """A config.yaml with `${oc.env:...}` (its manifest re-signed): export exits 2 and the secret
    appears nowhere (the attack put it into config.json)."""
    run, step = _copy(saved, tmp_path)
    _plant_secret(step, "max_position_embeddings", "${oc.env:FAKE_SECRET_TOKEN}")
    out = tmp_path / "hf"
    monkeypatch.setenv("FAKE_SECRET_TOKEN", SECRET)  # in the environment export runs in
    proc = cli("export", f"export.checkpoint={step}", f"export.output={out}", cwd=tmp_path)
    line = error_line(proc)
    assert "model.max_position_embeddings holds an interpolation" in line, line
    assert SECRET not in proc.stdout + proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def test_an_adapters_base_name_is_never_resolved(saved, tmp_path, monkeypatch):
    """The LoRA path of the same attack: `init_path: ${oc.env:...}` went into adapter_config.json
    (base_model_name_or_path) through export's run_config; it is refused there, and the message
    names the interpolation, never its value."""
    from ftcore.export import run_config

    monkeypatch.setenv("FAKE_SECRET_TOKEN", SECRET)
    run, step = _copy(saved, tmp_path)
    _plant_secret(step, "init_path", "${oc.env:FAKE_SECRET_TOKEN}")
    with pytest.raises(FtcoreError, match=r"model\.init_path holds an interpolation") as info:
        run_config(step)
    assert SECRET not in str(info.value)


def test_resume_never_resolves_the_saved_config(saved, tmp_path, monkeypatch):
    """common.pt's copy of the config is data too: a differing model key is reported by name, its
    planted `${oc.env:...}` refused, never printed resolved."""
    run, step = _copy(saved, tmp_path)
    common = torch.load(step / "common.pt", weights_only=True)
    common["ftcore"]["config"] = common["ftcore"]["config"].replace(
        "max_position_embeddings:", "max_position_embeddings: ${oc.env:FAKE_SECRET_TOKEN} #", 1
    )
    torch.save(common, step / "common.pt")
    _sign(step, "common.pt")
    monkeypatch.setenv("FAKE_SECRET_TOKEN", SECRET)
    with pytest.raises(FtcoreError, match="holds an interpolation") as info:
        store.load(saved[1], step)
    assert SECRET not in str(info.value)


def test_what_ftcore_writes_holds_no_interpolation(saved):
    """config.yaml of the run and of its checkpoint are written resolved, and read back as data."""
    from ftcore.export import run_config

    for f in (saved[0] / "config.yaml", saved[0] / "checkpoints" / "step_1" / "config.yaml"):
        assert "${" not in f.read_text(), f
    assert run_config(saved[0] / "checkpoints" / "step_1").model.num_layers == 4


# ------------------------------------------------------------ 2: storage entries stay inside


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_storage_pointed_at_another_runs_files_is_refused(saved, tmp_path, how):
    """Every `.distcp` removed, `.metadata`'s storage pointed at another run's files, manifest
    re-signed: export's reader and resume (checkpoint.resume=PATH) refuse it (the attack exported
    and resumed that run's tensors)."""
    from ftcore.hf.ckpt_reader import CheckpointReader

    other, _ = _copy(saved, tmp_path, "other")
    run, step = _copy(saved, tmp_path)
    md = FileSystemReader(str(step)).read_metadata()
    gone = sorted(p.name for p in step.glob("*.distcp"))
    for p in step.glob("*.distcp"):
        p.unlink()
    target = other / "checkpoints" / "step_1"
    for info in md.storage_data.values():
        there = target / info.relative_path
        info.relative_path = str(there) if how == "absolute" else os.path.relpath(there, step)
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _sign(step, ".metadata", drop=tuple(gone))
    with pytest.raises(FtcoreError, match=r"export\.checkpoint: .*storage entry names .*outside"):
        CheckpointReader(step)
    with pytest.raises(FtcoreError, match=r"checkpoint\.resume: .*storage entry names .*outside"):
        store.load(saved[1], step)


# --------------------------------------------------------------------- 3: no link is followed


def test_planted_links_in_a_run_directory_are_refused(saved, tmp_path):
    """config.yaml and .reference_logps.pt.tmp planted as links to a victim's files, and
    `checkpoints -> another run's checkpoints`: `ftcore.train` with resume=auto and keep=1 exits 2
    before writing anything; the victims and the other run's steps are untouched (the attack
    replaced both files and deleted the other run's step_1)."""
    other, _ = _copy(saved, tmp_path, "other")
    run = tmp_path / "run"
    run.mkdir()
    victims = {
        name: tmp_path / f"victim_{i}"
        for i, name in enumerate(("config.yaml", ".reference_logps.pt.tmp"))
    }
    for name, victim in victims.items():
        victim.write_text("precious")
        (run / name).symlink_to(victim)
    (run / "checkpoints").symlink_to(other / "checkpoints")
    before = sorted(str(p.relative_to(other)) for p in other.rglob("*"))
    proc = cli("train", *TINY, "launcher.nproc_per_node=1", f"run.dir={run}", "train.max_steps=3",
               "checkpoint.keep=1", "checkpoint.save_at_end=true", cwd=tmp_path)  # fmt: skip
    line = error_line(proc)
    assert "run.dir:" in line and "is a symbolic link" in line, line
    assert all(v.read_text() == "precious" for v in victims.values())
    assert sorted(str(p.relative_to(other)) for p in other.rglob("*")) == before


def test_reference_logps_are_never_written_through_a_link(saved, tmp_path):
    """objectives/dpo/ref_store.save writes its temporary anew (O_EXCL | O_NOFOLLOW), then renames it."""
    from ftcore.training.objectives.dpo import ref_store

    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (run / f".{ref_store.FILE}.tmp").symlink_to(victim)
    state = NS(run_dir=run, extra={ref_store.PENDING: {"version": 1, "key": "k"}})
    ref_store.save(state)
    assert victim.read_text() == "precious"
    assert torch.load(run / ref_store.FILE, weights_only=True)["key"] == "k"


def test_keep_never_deletes_through_a_linked_checkpoints(saved, tmp_path):
    """resume=auto refuses `checkpoints -> another run's`, even past the owner check (lstat)."""
    other, _ = _copy(saved, tmp_path, "other")
    shutil.copytree(other / "checkpoints" / "step_1", other / "checkpoints" / "step_2")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(other / "checkpoints")
    state = NS(cfg=NS(checkpoint=NS(resume="auto", verify=True, keep=1), run=NS(id=None)),
               run_dir=run, info=NS(rank=0), extra={})  # fmt: skip
    with pytest.raises(FtcoreError, match=r"checkpoint\.resume: .*checkpoints is a symbolic link"):
        store.resolve(state)
    store._apply_keep(state, 5)  # a keep after a save would not follow it either
    assert (other / "checkpoints" / "step_1" / ".metadata").is_file()


# ------------------------------------------------------- 6: weights_only whatever the env says


def test_common_pt_payload_never_runs_whatever_the_environment(saved, tmp_path, monkeypatch):
    """TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 and a planted common.pt pickle (manifest re-signed):
    resume and megatron's own load refuse it, and the payload never runs."""
    from megatron.core import dist_checkpointing

    from ftcore.checkpoint import resume
    from ftcore.runtime import cpu

    run, step = _copy(saved, tmp_path)
    marker = tmp_path / "payload_ran"
    torch.save({"ftcore": _payload(marker)}, step / "common.pt")
    _sign(step, "common.pt")
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(FtcoreError, match=r"common\.pt is not plain data"):
        store.load(saved[1], step)
    state = saved[1]
    with pytest.raises(BaseException, match=r"common\.pt is not plain data"):
        with cpu.device_mode(), safe_files.megatron_readers():
            sd = resume.sharded_state_dict(state, is_loading=True, optim=None)
            dist_checkpointing.load(sd, str(step))
    assert not marker.exists()


# ------------------------------------------------------------- TE's FP8 state (extra state)


def _te_recipe_module():
    """A stand-in for transformer_engine.common.recipe (TE is not installed here), so that a
    state pickled as TE's get_extra_state pickles it names the same globals."""
    from dataclasses import dataclass
    from enum import Enum
    from typing import NamedTuple

    names = ("transformer_engine", "transformer_engine.common", "transformer_engine.common.recipe")
    mods = {n: types.ModuleType(n) for n in names}

    class _FormatHelper(NamedTuple):
        max_fwd: float
        max_bwd: float

    class Format(Enum):
        HYBRID = _FormatHelper(max_fwd=448, max_bwd=57344)

    @dataclass
    class DelayedScaling:
        margin: int = 0
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024

    for cls in (_FormatHelper, Format, DelayedScaling):
        cls.__module__, cls.__qualname__ = names[-1], cls.__name__
        setattr(mods[names[-1]], cls.__name__, cls)
    return mods, DelayedScaling


def test_te_extra_state_is_checked_before_te_unpickles_it(monkeypatch):
    """TE's FP8 state as its get_extra_state writes it (pickle.dumps of CPU tensors, a recipe and
    plain values) passes; a pickle naming anything else is refused, and its payload never runs."""
    mods, recipe = _te_recipe_module()
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    state = {"recipe": recipe(), "scale_fwd": torch.ones(3), "amax_history_fwd": torch.zeros(4, 3),
             "extra_fp8_variables": {"fp8_checkpoint": True, "num_gemms": 3}}  # fmt: skip
    safe_files.check_extra_state(pickle.dumps(state), "layer._extra_state")
    marker = Path(os.devnull + "_never")
    with pytest.raises(FtcoreError, match="is not Transformer Engine's FP8 state"):
        safe_files.check_extra_state(pickle.dumps({"recipe": _payload(marker)}), "x._extra_state")
    inner = io.BytesIO()
    torch.save(_payload(marker), inner)  # a payload inside a tensor's storage bytes
    with pytest.raises(FtcoreError, match="is not plain data"):
        safe_files.check_extra_state(_storage_pickle(inner.getvalue()), "x._extra_state")
    assert not marker.exists()


class _Storage:
    def __init__(self, data: bytes):
        self.data = data

    def __reduce__(self):
        import torch.storage

        return (torch.storage._load_from_bytes, (self.data,))


def _storage_pickle(data: bytes) -> bytes:
    """A pickle calling torch.storage._load_from_bytes(data), as a pickled tensor's storage does
    (torch.load(weights_only=False) of `data` in TE's own pickle.loads)."""
    return pickle.dumps(_Storage(data))


def test_an_extra_state_payload_is_refused_inside_megatrons_load(saved, tmp_path):
    """A module's `_extra_state` byte item holding a uint8 tensor of pickled bytes (TE's format)
    that name a payload: torch.load(weights_only=True) takes the tensor, TE's set_extra_state
    would unpickle it on a GPU; the load planner refuses it first (on CPU here)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ftcore.checkpoint import resume
    from ftcore.runtime import cpu

    run, step = _copy(saved, tmp_path)
    md = FileSystemReader(str(step)).read_metadata()
    fqn = next(k for k, v in md.state_dict_metadata.items()
               if isinstance(v, BytesStorageMetadata) and "_extra_state" in k)  # fmt: skip
    info = md.storage_data[next(i for i in md.storage_data if i.fqn == fqn)]
    buf = io.BytesIO()
    torch.save(torch.frombuffer(bytearray(pickle.dumps({"recipe": _payload(tmp_path / "ran")})),
                                dtype=torch.uint8), buf)  # fmt: skip
    with open(step / info.relative_path, "ab") as f:
        info.offset = f.seek(0, os.SEEK_END)
        f.write(buf.getvalue())
    info.length = len(buf.getvalue())
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _sign(step, ".metadata", info.relative_path)
    state = saved[1]
    with pytest.raises(BaseException) as got:
        with cpu.device_mode(), safe_files.megatron_readers():
            sd = resume.sharded_state_dict(state, is_loading=True, optim=None)
            dist_checkpointing.load(sd, str(step))
    assert "is not Transformer Engine's FP8 state" in str(got.value), got.value
    assert not (tmp_path / "ran").exists()


# ---------------------------------------------------------- 10: overwrite only ftcore's export


def test_overwrite_replaces_only_what_ftcore_exported(saved, tmp_path):
    """A copy of a Hugging Face model (config.json + model.safetensors) with notes beside it is no
    export of ftcore's: export.overwrite refuses it (the attack deleted NOTES.md); an export ftcore
    wrote carries its marker and is replaced."""
    from ftcore.config.schema import assets_dir
    from ftcore.export import check_output, run_config
    from ftcore.hf.export import export_checkpoint

    copy = tmp_path / "tiny_base"
    shutil.copytree(assets_dir() / "tiny_base", copy)
    (copy / "NOTES.md").write_text("mine")
    with pytest.raises(FtcoreError, match=r"export\.output: .*holds no previous export"):
        check_output(copy, overwrite=True)
    assert (copy / "NOTES.md").read_text() == "mine"
    step = saved[0] / "checkpoints" / "step_1"
    out = export_checkpoint(step, run_config(step), tmp_path / "hf")
    assert (out / safe_files.EXPORT_MARKER).is_file()
    check_output(out, overwrite=True)
