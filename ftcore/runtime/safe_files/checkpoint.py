"""A checkpoint directory (torch.distributed.checkpoint as megatron writes it), read as data.

- `read_metadata`: `.metadata` (torch pickles it) through an unpickler that admits only the classes
  torch's checkpoint metadata consists of, and every storage entry's `relative_path` inside the
  checkpoint (`paths.inside`): a `.metadata` pointing at another run's files is refused.
- `reader` / `megatron_readers()`: torch's FileSystemReader with that `.metadata` read; inside the
  block megatron's load uses it, reads every byte item with torch.load(weights_only=True) (torch's
  own planner uses weights_only=False), checks Transformer Engine's pickled FP8 state before TE
  unpickles it (`check_extra_state`), and reads common.pt with weights_only=True (megatron's own
  torch.load passes none, so TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD would turn it off).
- `read_common`: common.pt, weights_only=True. `read_latest`: `latest` names exactly `step_<N>`.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import stat
from pathlib import Path

from ftcore.errors import FtcoreError
from ftcore.runtime.safe_files.parse import load_tensors, torch_load
from ftcore.runtime.safe_files.paths import inside, open_read

STEP = re.compile(r"step_(\d+)")
COMMON = "common.pt"
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
    """torch.distributed.checkpoint's Metadata from the `.metadata` file `path`, as data only,
    every storage file it names inside the checkpoint directory."""
    from torch.distributed.checkpoint.metadata import Metadata

    path = Path(path)
    try:
        with open_read(path, field, root=path.parent) as f:
            md = _Unpickler(f).load()
    except FtcoreError:
        raise
    except Exception as e:  # noqa: BLE001 - any unreadable or foreign pickle is refused alike
        raise FtcoreError(
            f"{path} is not checkpoint metadata ({type(e).__name__}: {str(e)[:200]}); it was not loaded",
            field=field,
            fix="load only checkpoints you or ftcore wrote; use an earlier step_<N> or start over",
        ) from e
    if not isinstance(md, Metadata):
        raise FtcoreError(f"{path} is not checkpoint metadata (it holds a {type(md).__name__})",
                          field=field, fix="load only checkpoints you or ftcore wrote")  # fmt: skip
    for rel in sorted(
        {str(getattr(i, "relative_path", "")) for i in (md.storage_data or {}).values()}
    ):
        inside(path.parent, rel, field, what=f"{path}: a storage entry")
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


# Transformer Engine's FP8 state (module/base.py get_extra_state: pickle.dumps of a dict of CPU
# tensors, a recipe and plain values, as a uint8 tensor) holds only these globals; set_extra_state
# unpickles it with pickle.loads (TE < 2.18, without asking), so it is checked first, here.
TE_RECIPE = "transformer_engine.common.recipe"
TE_RECIPE_CLASSES = {"Format", "_FormatHelper", "MMParams", "QParams", "Recipe", "DelayedScaling",
                     "Float8CurrentScaling", "MXFP8BlockScaling", "Float8BlockScaling",
                     "NVFP4BlockScaling"}  # fmt: skip


class _Stand:
    """Stands in for a TE recipe class while checking (TE need not be installed to check)."""

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        pass


def _storage_weights_only(data: bytes):
    return load_tensors(
        io.BytesIO(data), "a tensor inside Transformer Engine's state", "checkpoint"
    )


class _ExtraStateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        if (module, name) in (
            ("torch._utils", "_rebuild_tensor_v2"),
            ("collections", "OrderedDict"),
        ):
            return super().find_class(module, name)
        if (module, name) == (
            "torch.storage",
            "_load_from_bytes",
        ):  # torch.load(weights_only=False)
            return _storage_weights_only
        if module == TE_RECIPE and name in TE_RECIPE_CLASSES:
            return _Stand
        if module == "torch" and (
            name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which TE's FP8 state never holds")


def check_extra_state(data: bytes, where: str, field: str = "checkpoint.resume") -> None:
    """Refuse (FtcoreError) pickled module extra state naming anything but what Transformer
    Engine's FP8 state consists of, before TE's set_extra_state unpickles it: with every global
    admitted here, TE's own pickle.loads calls nothing else (its inner storages were read with
    weights_only=True here)."""
    try:
        _ExtraStateUnpickler(io.BytesIO(data)).load()
    except Exception as e:  # noqa: BLE001 - anything the restricted unpickler refuses
        raise FtcoreError(
            f"the checkpoint item {where} is not Transformer Engine's FP8 state ({type(e).__name__}: "
            f"{str(e)[:200]}); it was not loaded",
            field=field,
            fix="load only checkpoints you or ftcore wrote; use an earlier step_<N>",
        ) from None


def _planner_class():
    import torch
    from megatron.core.dist_checkpointing.strategies.torch import MCoreLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(MCoreLoadPlanner):
        """megatron's load planner with each byte item (a module's `_extra_state`, megatron's
        ShardedObjects) read by torch.load(weights_only=True): tensors and plain containers
        only (torch's DefaultLoadPlanner.load_bytes uses weights_only=False); a uint8 tensor of
        `_extra_state` (TE's pickled FP8 state) is checked by `check_extra_state`."""

        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            obj = load_tensors(value, f"the checkpoint item {fqn}", "checkpoint.resume")
            if (
                "_extra_state" in fqn
                and isinstance(obj, torch.Tensor)
                and obj.dtype == torch.uint8
                and obj.numel()
            ):
                check_extra_state(obj.detach().cpu().numpy().tobytes(), fqn)
            # the rest of torch 2.13's DefaultLoadPlanner.load_bytes, with the safely read object
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], obj)
            else:
                self.state_dict[fqn] = obj

    return SafeLoadPlanner


def read_common(step_dir: Path, field: str = "checkpoint.resume"):
    """megatron's common.pt of a checkpoint: torch.load(weights_only=True), whatever the
    environment says."""
    return torch_load(Path(step_dir) / COMMON, field, root=step_dir)


def _load_sharded_objects(self, sharded_objects_state_dict, checkpoint_dir):
    """megatron's TorchCommonLoadStrategy.load_sharded_objects (`<key>.pt` files), weights only."""
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace

    root = Path(checkpoint_dir)
    return dict_list_map_inplace(
        lambda sh: torch_load(inside(root, f"{sh.unique_key}.pt", "checkpoint.resume"),
                              "checkpoint.resume", root=root),
        sharded_objects_state_dict,
    )  # fmt: skip


@contextlib.contextmanager
def megatron_readers():
    """Inside this block megatron's torch_dist load reads `.metadata` through a SafeReader, every
    byte item through a SafeLoadPlanner, and common.pt (and any `<key>.pt` object) with
    weights_only=True: megatron builds its reader in one module function, its planner by name,
    and loads common.pt with a bare torch.load."""
    from megatron.core.dist_checkpointing.strategies import torch as strategy
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy as Common

    original = (strategy._get_filesystem_reader, strategy.MCoreLoadPlanner, Common.load_common,
                Common.load_sharded_objects)  # fmt: skip
    strategy._get_filesystem_reader = lambda checkpoint_dir, cache_metadata=False: reader(
        checkpoint_dir
    )
    strategy.MCoreLoadPlanner = _planner_class()
    Common.load_common = lambda self, checkpoint_dir: read_common(Path(checkpoint_dir))
    Common.load_sharded_objects = _load_sharded_objects
    try:
        yield
    finally:
        (strategy._get_filesystem_reader, strategy.MCoreLoadPlanner, Common.load_common,
         Common.load_sharded_objects) = original  # fmt: skip


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
