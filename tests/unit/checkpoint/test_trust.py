"""Issue 46: a checkpoint is data, never code. A real checkpoint of the tiny model (one process,
saved once per module) is tampered with: a `.metadata` pickle with a payload (its manifest updated
to match, as its author would) is refused by resume, by megatron's own read and by
`ftcore.export` (exit 2), and the payload never runs; `latest` names only `step_<N>` of its own
`checkpoints/`; export checks the manifest; temporaries never follow a symlink."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import zlib
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from torch.distributed.checkpoint import FileSystemReader

from ftcore.checkpoint import store
from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files
from tests.support.cli import cli, error_line


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(run directory with checkpoints/step_1 and latest, the live one-process run)."""
    from ftcore.runtime import dist
    from tests.support.ckpt_cases import train
    from tests.support.layouts import build

    run_dir = tmp_path_factory.mktemp("trust") / "run"
    state = build(["checkpoint.resume=never", "launcher.threads_per_rank=1"], str(run_dir))
    train(state, 1)
    store.save(state)
    yield run_dir, state
    dist.teardown()


class _Payload:
    """What a crafted `.metadata` runs when unpickled: it creates `marker`."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def _tampered(saved, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run whose step_1/.metadata carries a payload, manifest updated to match."""
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    step = run / "checkpoints" / "step_1"
    marker = tmp_path / "payload_ran"
    md = FileSystemReader(str(step)).read_metadata()
    md.storage_meta = _Payload(marker)  # rides inside real metadata
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _sign(step, ".metadata")
    return run, marker


def _sign(step: Path, *names: str) -> None:
    """Update the manifest's sizes and CRC32s of `names`, as a checkpoint's author could."""
    manifest = json.loads((step / "manifest.json").read_text())
    for name in names:
        data = (step / name).read_bytes()
        manifest["files"][name] = [len(data), zlib.crc32(data)]
    (step / "manifest.json").write_text(json.dumps(manifest))


def _run_state(run: Path, resume: str = "auto", run_id: str | None = None):
    return NS(cfg=NS(checkpoint=NS(resume=resume, verify=True), run=NS(id=run_id)), run_dir=run,
              info=NS(rank=0), extra={})  # fmt: skip


def test_real_metadata_reads_through_the_allowlist(saved):
    """Every class a real checkpoint's `.metadata` holds is admitted, and it reads the same."""
    step = saved[0] / "checkpoints" / "step_1"
    ours = safe_files.read_metadata(step / ".metadata")
    theirs = FileSystemReader(str(step)).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata and ours.state_dict_metadata
    assert ours.storage_data == theirs.storage_data


def test_payload_metadata_is_refused_on_resume(saved, tmp_path):
    run, marker = _tampered(saved, tmp_path)
    with pytest.raises(
        FtcoreError, match=r"checkpoint\.resume: .*step_1/\.metadata is not checkpoint metadata"
    ):
        store.maybe_resume(_run_state(run))
    assert not marker.exists()


def _tampered_item(saved, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run whose first byte item (a module's `_extra_state`, torch.save'd into a
    .distcp file) is a torch.save'd payload: appended to its file, its storage entry in
    `.metadata` pointed at it, the manifest updated to match, as its author would."""
    import io

    import torch
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    step = run / "checkpoints" / "step_1"
    marker = tmp_path / "payload_ran"
    md = FileSystemReader(str(step)).read_metadata()
    fqn = next(k for k, v in md.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    buf = io.BytesIO()
    torch.save(_Payload(marker), buf)
    with open(step / info.relative_path, "ab") as f:
        offset = f.seek(0, os.SEEK_END)
        f.write(buf.getvalue())
    info.offset, info.length = offset, len(buf.getvalue())
    (step / ".metadata").write_bytes(pickle.dumps(md))
    _sign(step, ".metadata", info.relative_path)
    return run, marker


# (how the checkpoint is tampered with, what the refusal says)
PAYLOADS = {
    "metadata": (_tampered, [".metadata is not checkpoint metadata"]),
    # torch's own load planner reads byte items with torch.load(weights_only=False)
    "byte_item": (_tampered_item, ["_extra_state", "is not plain data"]),
}


@pytest.mark.parametrize("where", PAYLOADS)
def test_payload_is_refused_inside_megatrons_load(saved, tmp_path, where):
    """The reads megatron's load makes itself (past ftcore's own check: `.metadata` and every
    byte item) are the restricted ones, and the payload never runs."""
    from megatron.core import dist_checkpointing

    from ftcore.checkpoint import resume
    from ftcore.runtime import cpu

    tamper, says = PAYLOADS[where]
    run, marker = tamper(saved, tmp_path)
    state = saved[1]
    with pytest.raises(BaseException) as info:  # torch's CheckpointException is a BaseException
        with cpu.device_mode(), safe_files.megatron_readers():
            sd = resume.sharded_state_dict(
                state, is_loading=True, optim=resume.optim_format(state.cfg)
            )
            dist_checkpointing.load(sd, str(run / "checkpoints" / "step_1"))
    assert all(s in str(info.value) for s in says), info.value
    assert not marker.exists()


@pytest.mark.parametrize("where", PAYLOADS)
def test_cli_resume_of_a_payload_checkpoint_exits_2(saved, tmp_path, where):
    """As a user meets it: `ftcore.train` resuming (checkpoint.resume=auto) from the crafted run."""
    from tests.support.tiny import TINY

    tamper, says = PAYLOADS[where]
    run, marker = tamper(saved, tmp_path)
    proc = cli("train", *TINY, "launcher.nproc_per_node=1", f"run.dir={run}", "train.max_steps=2",
               cwd=tmp_path)  # fmt: skip
    line = error_line(proc)
    assert "checkpoint.resume:" in line and says[-1] in line, line
    assert not marker.exists()


def test_payload_metadata_is_refused_by_export(saved, tmp_path):
    run, marker = _tampered(saved, tmp_path)
    out = tmp_path / "hf"
    proc = cli("export", f"export.checkpoint={run}", f"export.output={out}", cwd=tmp_path)
    line = error_line(proc)
    assert "export.checkpoint:" in line and ".metadata is not checkpoint metadata" in line, line
    assert not marker.exists() and not out.exists()


def test_export_checks_the_manifest(saved, tmp_path):
    """A corrupt shard (same size, one byte flipped) is refused, not exported silently."""
    from ftcore.checkpoint.files import check_manifest
    from ftcore.export import resolve_step_dir

    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    step = resolve_step_dir(str(run))
    victim = max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(FtcoreError, match=rf"export\.checkpoint: .*{victim.name} is corrupt"):
        check_manifest(step, checksums=True, field="export.checkpoint")


@pytest.mark.parametrize("how", ["absolute", "dotdot", "inner_dotdot", "symlink", "step_link"])
def test_latest_names_only_a_step_of_its_own_directory(saved, tmp_path, how):
    from ftcore.export import resolve_step_dir

    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    root = run / "checkpoints"
    elsewhere = tmp_path / "elsewhere" / "checkpoints"
    shutil.copytree(root, elsewhere)
    latest = root / "latest"
    if how == "absolute":
        latest.write_text(f"{elsewhere / 'step_1'}\n")
    elif how == "dotdot":
        latest.write_text("../../elsewhere/checkpoints/step_1\n")
    elif how == "inner_dotdot":
        latest.write_text("step_1/../../../elsewhere/checkpoints/step_1\n")
    elif how == "symlink":
        latest.unlink()
        latest.symlink_to(elsewhere / "latest")
    else:
        shutil.rmtree(root / "step_1")
        (root / "step_1").symlink_to(elsewhere / "step_1")
    with pytest.raises(FtcoreError, match=r"checkpoint\.resume: .*latest"):
        store.resolve(_run_state(run))
    with pytest.raises(FtcoreError, match=r"export\.checkpoint: .*latest"):
        resolve_step_dir(str(run))


def test_temporaries_never_follow_a_symlink(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (root / ".latest.tmp").symlink_to(victim)
    store._publish_latest(root, "step_3")
    assert victim.read_text() == "precious"
    assert (root / "latest").read_text() == "step_3\n" and not (root / "latest").is_symlink()
    (root / "step_3").mkdir()
    (root / "step_3" / "manifest.json.tmp").symlink_to(victim)
    from ftcore.checkpoint import files

    files.write_manifest(root / "step_3", {"step": 3})
    assert victim.read_text() == "precious"
    assert json.loads((root / "step_3" / "manifest.json").read_text())["step"] == 3


def test_export_overwrite_removes_only_a_previous_export(saved, tmp_path):
    """Issue 46: export.overwrite=true with export.output at a directory that holds no export
    (here a stand-in for $HOME) exits 2 and leaves it untouched."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("key")
    (home / "notes.txt").write_text("mine")
    before = sorted(str(p.relative_to(home)) for p in home.rglob("*"))
    proc = cli("export", f"export.checkpoint={saved[0]}", f"export.output={home}",
               "export.overwrite=true", cwd=tmp_path)  # fmt: skip
    line = error_line(proc)
    assert "export.output:" in line and "holds no previous export" in line, line
    assert sorted(str(p.relative_to(home)) for p in home.rglob("*")) == before


def test_what_counts_as_a_previous_export(tmp_path):
    from ftcore.export import check_output

    model, adapter, empty, other = (tmp_path / n for n in ("model", "adapter", "empty", "other"))
    for d in (model, adapter, empty, other):
        d.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"")
    (adapter / "adapter_config.json").write_text("{}")
    (other / "config.json").write_text("{}")  # a config alone is not an export
    (other / "model.safetensors").write_bytes(b"")  # nor a model ftcore did not write (issue 51)
    for d in (model, adapter):  # what ftcore writes into each export it makes
        safe_files.mark_export(d, "test")
    for d in (model, adapter, empty):
        check_output(d, overwrite=True)
    link = tmp_path / "link"
    link.symlink_to(model)
    for d in (other, link):
        with pytest.raises(FtcoreError, match="holds no previous export"):
            check_output(d, overwrite=True)
    with pytest.raises(FtcoreError, match="already exists"):
        check_output(model, overwrite=False)


def test_export_never_takes_a_hub_name_for_the_tokenizer(saved, tmp_path):
    """Issue 46: a config.yaml naming a Hub id as its tokenizer is refused before anything is
    written (export never downloads)."""
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    for f in (run / "checkpoints" / "step_1" / "config.yaml", run / "config.yaml"):
        if f.is_file():
            f.write_text(
                f.read_text().replace("tokenizer: null", "tokenizer: meta-llama/Llama-3.1-8B")
            )
    from ftcore.checkpoint import files

    files.write_manifest(run / "checkpoints" / "step_1", {"step": 1})  # config.yaml changed
    out = tmp_path / "hf"
    line = error_line(
        cli("export", f"export.checkpoint={run}", f"export.output={out}", cwd=tmp_path)
    )
    assert "meta-llama/Llama-3.1-8B" in line and "not a local directory" in line, line
    assert not out.exists() and not list(tmp_path.glob(".hf*"))


def test_a_run_directory_of_another_user_is_not_resumed_automatically(saved, tmp_path, monkeypatch):
    """Issue 46: checkpoint.resume=auto refuses a run directory (or its checkpoints/, latest or
    step) another user owns, as a pre-created `slurm-<next id>/` would be; naming it is allowed."""
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    me = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: me + 1)  # as another user sees this directory
    with pytest.raises(FtcoreError, match=r"checkpoint\.resume: .*belongs to user id"):
        store.resolve(_run_state(run))
    step = run / "checkpoints" / "step_1"
    assert store.resolve(_run_state(run, str(step))) == step  # named explicitly: the user's call
    assert store.resolve(_run_state(run, "never")) is None


def test_resume_auto_takes_only_its_own_runs_checkpoints(saved, tmp_path):
    """A job's run directory (run.id set by the job script) resumes only what that run wrote: the
    same job id from another cluster, or a recycled one, is refused unless named explicitly."""
    run = tmp_path / "run"
    shutil.copytree(saved[0], run)
    step = run / "checkpoints" / "step_1"
    manifest = json.loads((step / "manifest.json").read_text())
    manifest["run_id"] = "slurm:other:4242"
    (step / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(FtcoreError, match=r"written by run slurm:other:4242, not by this run"):
        store.resolve(_run_state(run, run_id="slurm:c1:4242"))
    assert store.resolve(_run_state(run, run_id="slurm:other:4242")) == step
    assert store.resolve(_run_state(run, resume=str(step), run_id="slurm:c1:4242")) == step
    assert store.resolve(_run_state(run)) == step  # no id of its own (a local run): no claim


def test_a_save_records_the_runs_id(saved, tmp_path, monkeypatch):
    run_dir, state = saved
    monkeypatch.setattr(state.cfg.run, "id", "slurm:c1:4242")
    monkeypatch.setattr(state, "run_dir", tmp_path / "run")
    monkeypatch.setattr(state, "extra", {})  # this step's save of the fixture is elsewhere
    store.save(state, blocking=True)
    step = tmp_path / "run" / "checkpoints" / f"step_{state.step}"
    assert json.loads((step / "manifest.json").read_text())["run_id"] == "slurm:c1:4242"
