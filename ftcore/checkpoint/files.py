"""The files of a checkpoint directory: verify before publish, manifest of checksums, scan.

- `verify_written`: after megatron wrote a checkpoint (still under its temporary name), check that
  every tensor is whole (the chunks in torch.distributed.checkpoint's `.metadata` cover it), that
  every tensor key this rank holds was written (a save plan that drops shards fails here, not at
  the next resume), and that every storage file exists and is long enough.
- `write_manifest` / `check_manifest`: `manifest.json` lists every file with its size and CRC32,
  each rank hashing a share of the files. A directory without it is incomplete; a file whose size
  or checksum differs is corrupt and is named in an FtcoreError.
- `scan`: which directories under checkpoints/ are published, unpublished or incomplete.
"""

from __future__ import annotations

import json
import math
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor

from ftcore.errors import FtcoreError
from ftcore.runtime import collectives, safe_files

MANIFEST = "manifest.json"
TMP_PREFIX = ".tmp_step_"
_STEP = re.compile(r"^step_(\d+)$")


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    rank, world = _rank_world()
    if world == 1:
        return [obj]
    out = [None] * world
    collectives.all_gather_object(out, obj)
    return out


def _raise_first(errors: list, path: Path, fix: str, field: str = "checkpoint") -> None:
    """Collective: every rank raises the same FtcoreError if any rank found a problem."""
    found = [e for errs in _gather(errors) for e in errs]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise FtcoreError(found[0] + more, field=field, fix=fix)


def _crc32(path: Path, root: Path) -> int:
    crc = 0
    with safe_files.open_read(path, "checkpoint", root=root) as f:
        while chunk := f.read(1 << 23):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(path: Path) -> list[str]:
    """The files a save wrote (never a link, nor the manifest and its temporary)."""
    skip = (MANIFEST, MANIFEST + ".tmp")
    return sorted(
        str(p.relative_to(path))
        for p in path.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name not in skip
    )


def verify_written(path: Path, sharded_sd: dict) -> None:
    """Collective. Raises (on every rank) if the checkpoint megatron just wrote is not whole."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    errors = []
    try:
        md = safe_files.read_metadata(path / ".metadata", field="checkpoint")
    except Exception as e:  # noqa: BLE001 - reported below, collectively
        md, errors = None, [f"{path}/.metadata unreadable after save: {e}"]
    if md is not None:
        keys = {v.key for v in nested_values(sharded_sd) if isinstance(v, ShardedTensor)}
        missing = sorted(keys - set(md.state_dict_metadata))
        if missing:
            errors.append(f"save of {path} dropped tensors {missing[:3]}")
        rank, world = _rank_world()
        if rank == 0:
            for key, meta in md.state_dict_metadata.items():
                if isinstance(meta, TensorStorageMetadata):
                    have = sum(math.prod(c.sizes) for c in meta.chunks)
                    if have != math.prod(meta.size):
                        errors.append(
                            f"save of {path}: tensor {key} has {have} of {math.prod(meta.size)} elements"
                        )
            ends: dict[str, int] = {}
            for info in md.storage_data.values():
                ends[info.relative_path] = max(
                    ends.get(info.relative_path, 0), info.offset + info.length
                )
            for rel, end in sorted(ends.items()):
                f = path / rel
                if not f.is_file() or f.stat().st_size < end:
                    errors.append(f"save of {path}: {rel} is missing or shorter than {end} bytes")
    _raise_first(errors, path, "check the filesystem (space, quota) and save again")


def write_manifest(path: Path, extra: dict) -> None:
    """Collective: each rank hashes its share of the files; rank 0 writes manifest.json last."""
    rank, world = _rank_world()
    files = _files(path) if rank == 0 else None
    if world > 1:
        box = [files]
        collectives.broadcast_object_list(box, src=0)
        files = box[0]
    mine = {
        rel: [(path / rel).stat().st_size, _crc32(path / rel, path)] for rel in files[rank::world]
    }
    merged: dict = {}
    for part in _gather(mine):
        merged.update(part)
    if rank == 0:
        body = dict(extra, files={k: merged[k] for k in sorted(merged)})
        tmp = path / (MANIFEST + ".tmp")
        safe_files.write_exclusive(tmp, json.dumps(body, indent=1).encode())
        os.replace(tmp, path / MANIFEST)


def read_manifest(path: Path, field: str = "checkpoint.resume") -> dict:
    m = path / MANIFEST
    if not m.is_file():
        raise FtcoreError(
            f"{m} is missing: {path} is not a complete ftcore checkpoint",
            field=field,
            fix="point checkpoints/latest (or checkpoint.resume) at a complete step_<N> directory",
        )
    try:
        manifest = json.loads(safe_files.read_text(m, field, root=path))
    except (ValueError, RecursionError) as e:  # any parse error, a 5,000-digit number too
        raise FtcoreError(f"{m} is corrupt ({type(e).__name__}: {str(e)[:200]})", field=field,
                          fix="resume from an earlier step_<N> (checkpoint.resume=PATH)") from None  # fmt: skip
    entries = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(entries, dict) or not all(
        isinstance(v, list) and len(v) == 2 and all(type(x) is int for x in v)
        for v in entries.values()
    ):
        raise FtcoreError(f"{m} is corrupt (no file list)", field=field,
                          fix="resume from an earlier step_<N> (checkpoint.resume=PATH)")  # fmt: skip
    return manifest


def check_manifest(path: Path, checksums: bool, field: str | None = None) -> None:
    """Collective: every file of the manifest present, same size and (optionally) same CRC32.
    `field`: the key an error names (export.checkpoint for ftcore.export; resume's by default)."""
    rank, world = _rank_world()
    errors = []
    manifest = read_manifest(path, field or "checkpoint.resume")
    files = sorted(manifest["files"].items())  # the same file for all: all raise alike
    for rel, (size, crc) in files[rank::world]:
        f = path / rel
        try:
            safe_files.inside(path, rel, field or "checkpoint.resume", what=str(path / MANIFEST))
        except FtcoreError:
            errors.append(f"{path / MANIFEST} names {rel}, outside the checkpoint")
            continue
        if not f.is_file():
            errors.append(f"checkpoint file {f} is missing")
        elif f.stat().st_size != size:
            errors.append(
                f"checkpoint file {f} is corrupt: {f.stat().st_size} bytes, {size} written"
            )
        elif checksums and _crc32(f, path) != crc:
            errors.append(
                f"checkpoint file {f} is corrupt: its checksum differs from the one written"
            )
    fix = ("resume from an earlier step_<N> (checkpoint.resume=PATH), or checkpoint.resume=never "
           "to start over") if field is None else f"{field}=<an earlier checkpoints/step_<N>>"  # fmt: skip
    _raise_first(errors, path, fix, field or "checkpoint")


@dataclass
class Scan:
    published: Path | None  # what checkpoints/latest names
    complete: list[tuple[int, Path]]  # step_<N> directories with a manifest, by step
    incomplete: list[
        Path
    ]  # temporary directories of saves that did not finish, step dirs without manifest


def scan(root: Path) -> Scan:
    published = safe_files.read_latest(root, "checkpoint.resume")
    complete, incomplete = [], []
    if root.is_dir():
        for d in sorted(root.iterdir()):
            m = _STEP.match(d.name)
            if d.name.startswith(TMP_PREFIX) or (m and not (d / MANIFEST).is_file()):
                incomplete.append(d)
            elif m and d.is_dir():
                complete.append((int(m.group(1)), d))
    complete.sort()
    return Scan(published, complete, incomplete)
