"""Files other people may have written, read as data and never as code (docs/checkpoints.md).

- `read_metadata`: a checkpoint's `.metadata` (torch.distributed.checkpoint pickles it) through an
  unpickler that admits only the classes torch's checkpoint metadata consists of; anything else
  is an FtcoreError naming the file (exit 2), and its payload never runs. `SafeReader` is torch's
  FileSystemReader reading it that way; `megatron_readers()` makes megatron's load use it, and
  read every byte item of the `.distcp` files (modules' `_extra_state`, megatron's sharded
  objects) with torch.load(weights_only=True) instead of torch's weights_only=False.
- `read_latest`: `checkpoints/latest` names exactly `step_<N>` in that `checkpoints/`, nothing else.
- `write_exclusive`: a temporary file created anew (O_EXCL, O_NOFOLLOW), never through a symlink
  someone left at its name.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import re
from pathlib import Path

from ftcore.errors import FtcoreError

STEP = re.compile(r"step_(\d+)")
_DCP = "torch.distributed.checkpoint."
# (module, name) of every class a `.metadata` of torch 2.13 / megatron-core 0.16.1 holds (listed
# from torch/distributed/checkpoint/{metadata,filesystem,planner}.py and checked against real
# checkpoints by tests/unit/checkpoint/test_trust.py); dtypes are admitted by value below.
ALLOWED = {
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # torch.strided & co., looked up by name
    (_DCP + "metadata", "Metadata"),
    (_DCP + "metadata", "MetadataIndex"),
    (_DCP + "metadata", "StorageMeta"),
    (_DCP + "metadata", "TensorStorageMetadata"),
    (_DCP + "metadata", "BytesStorageMetadata"),
    (_DCP + "metadata", "ChunkStorageMetadata"),
    (_DCP + "metadata", "TensorProperties"),
    (_DCP + "metadata", "_MEM_FORMAT_ENCODING"),
    (_DCP + "filesystem", "_StorageInfo"),
    (_DCP + "filesystem", "_StoragePrefix"),
    (_DCP + "planner", "SavePlan"),
    (_DCP + "planner", "WriteItem"),
    (_DCP + "planner", "WriteItemType"),
    (_DCP + "planner", "TensorWriteData"),
    (_DCP + "planner", "BytesIOWriteData"),
}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"it names {module}.{name}, which checkpoint metadata never holds"
        )


def read_metadata(path: Path, field: str = "checkpoint.resume"):
    """torch.distributed.checkpoint's Metadata from the `.metadata` file `path`, as data only."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        with open(path, "rb") as f:
            md = _Unpickler(f).load()
    except FileNotFoundError as e:
        raise FtcoreError(f"{path} is missing", field=field,
                          fix="point it at a complete checkpoints/step_<N> directory") from e  # fmt: skip
    except Exception as e:  # noqa: BLE001 - any unreadable or foreign pickle is refused alike
        raise FtcoreError(
            f"{path} is not checkpoint metadata ({type(e).__name__}: {str(e)[:200]}); it was not loaded",
            field=field,
            fix="load only checkpoints you or ftcore wrote; use an earlier step_<N> or start over",
        ) from e
    if not isinstance(md, Metadata):
        raise FtcoreError(f"{path} is not checkpoint metadata (it holds a {type(md).__name__})",
                          field=field, fix="load only checkpoints you or ftcore wrote")  # fmt: skip
    return md


def _reader_class():
    from megatron.core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(CachedMetadataFileSystemReader):
        """torch's FileSystemReader (megatron's caching one) with `.metadata` read as data only."""

        field = "checkpoint.resume"

        def read_metadata(self, *args, **kwargs):
            if self._cached_metadata is None:
                md = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))), self.field)
                if getattr(md, "storage_meta", None) is None:
                    md.storage_meta = StorageMeta()
                md.storage_meta.load_id = self.load_id  # as torch's own read_metadata does
                self._cached_metadata = md
            return self._cached_metadata

    return SafeReader


def reader(path: str | Path, field: str = "checkpoint.resume"):
    r = _reader_class()(str(path))
    r.field = field
    return r


def _planner_class():
    import io

    import torch
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(MCoreLoadPlanner):
        """megatron's load planner with each byte item (a module's `_extra_state`, megatron's
        ShardedObjects) read by torch.load(weights_only=True): tensors and plain containers
        only. torch's DefaultLoadPlanner.load_bytes reads them with weights_only=False, which
        runs whatever a crafted item's pickle names."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except Exception as e:  # noqa: BLE001 - any item torch's safe loader refuses
                raise FtcoreError(
                    f"the checkpoint item {read_item.dest_index.fqn} is not plain data "
                    f"({type(e).__name__}: {str(e)[:200]}); it was not loaded",
                    field="checkpoint.resume",
                    fix="load only checkpoints you or ftcore wrote; use an earlier step_<N>",
                ) from e
            # the rest of torch 2.13's DefaultLoadPlanner.load_bytes, with the safely read object
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeLoadPlanner


@contextlib.contextmanager
def megatron_readers():
    """megatron's torch_dist load strategy builds its FileSystemReader in one module function and
    its load planner by name: inside this block they are a SafeReader (every `.metadata` read of
    a load) and a SafeLoadPlanner (every byte item)."""
    from megatron.core.dist_checkpointing.strategies import torch as strategy

    original = strategy._get_filesystem_reader, strategy.MCoreLoadPlanner
    strategy._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: reader(
        checkpoint_dir
    )
    strategy.MCoreLoadPlanner = _planner_class()
    try:
        yield
    finally:
        strategy._get_filesystem_reader, strategy.MCoreLoadPlanner = original


def read_latest(root: Path, field: str) -> Path | None:
    """The directory `root/latest` publishes, or None without one. It must hold exactly
    `step_<N>` (no path, no `..`) and name a real directory of `root`, not a link."""
    latest = root / "latest"
    try:
        fd = os.open(latest, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:  # a symlink (ELOOP) or unreadable
        raise _bad_latest(latest, f"cannot be read as a plain file ({e.strerror})", field) from e
    try:
        import stat

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _bad_latest(latest, "is not a plain file", field)
        text = os.read(fd, 64).decode("utf-8", "replace").strip()
    finally:
        os.close(fd)
    if not STEP.fullmatch(text):
        raise _bad_latest(latest, f"holds {text[:40]!r}, not step_<N>", field)
    step = root / text
    if step.is_symlink():
        raise _bad_latest(latest, f"names {step}, a symbolic link", field)
    return step


def _bad_latest(latest: Path, what: str, field: str) -> FtcoreError:
    return FtcoreError(
        f"{latest} {what}: only a step_<N> directory in that checkpoints/ is ever loaded",
        field=field,
        fix=f"write step_<N> into {latest}, or name the checkpoint explicitly "
        f"({field}=<run.dir>/checkpoints/step_<N>)",
    )


def write_exclusive(path: Path, data: bytes) -> None:
    """Write `path` as a new file (an old one, or a symlink at its name, is removed first, never
    followed), fsync'd. For temporaries that are then renamed into place."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
