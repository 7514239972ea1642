"""Where a file from elsewhere may be read, and how ftcore writes without following a link.

A name that came from a file (a manifest entry, `.metadata`'s storage `relative_path`, an index
`weight_map` value, a `save_to_disk` file list) or a fixed name inside a directory that came from
elsewhere (a checkpoint's config.yaml, a model's config.json) is read only inside that directory:
relative, no `..`, and where its links lead still inside it. A Hugging Face cache snapshot
(`models--org--name/snapshots/<rev>/`) holds links into its repository's `blobs/`: there the
repository folder is the directory. The final open is O_NOFOLLOW on the resolved path, of a regular
file. A path the user typed is taken as given (links and all): naming it is trusting it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO, TextIO

from ftcore.errors import FtcoreError

MAX_READ_BYTES = 64 << 20  # a JSON/YAML/text file read whole (configs, manifests, templates)


def _container(root: Path) -> Path:
    """The directory whose inside a name of `root` must stay in (real path)."""
    real = Path(os.path.realpath(root))
    snapshots = real.parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith(
        ("models--", "datasets--")
    ):
        return snapshots.parent  # a Hugging Face cache snapshot: its links lead to ../../blobs
    return real


def _within(real: str, base: Path) -> bool:
    return real == str(base) or real.startswith(str(base) + os.sep)


def inside(root: Path, name: str, field: str, what: str = "") -> Path:
    """`root / name` for a name read from a file or fixed inside a directory from elsewhere:
    relative, without `..`, and (links followed) still inside `root`. Else an FtcoreError."""
    root = Path(root)
    pure = PurePosixPath(str(name))
    if not str(name) or "\x00" in str(name) or pure.is_absolute() or ".." in pure.parts:
        raise _outside(root, str(name), field, what)
    path = root / str(name)
    if not _within(os.path.realpath(path), _container(root)):
        raise _outside(root, str(name), field, what)
    return path


def _outside(root: Path, name: str, field: str, what: str) -> FtcoreError:
    by = f"{what} names" if what else "the name"
    return FtcoreError(
        f"{by} {name[:200]!r}, which is outside {root} (an absolute path, `..` or a link leaving "
        "it): a file from elsewhere is read only inside its own directory",
        field=field,
        fix="use files whose names stay inside their directory (copy the files in, no links out)",
    )


def open_read(path: Path, field: str, *, root: Path | None = None) -> BinaryIO:
    """`path` open for reading (binary), a regular file. With `root` it must be inside it
    (`inside`); the resolved path is opened with O_NOFOLLOW."""
    path = Path(path)
    if root is not None:
        inside(root, os.path.relpath(path, root), field)
    real = os.path.realpath(path)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as e:
        raise FtcoreError(f"{path} is missing", field=field,
                          fix="point it at a complete directory (every file it names)") from e  # fmt: skip
    except OSError as e:
        raise FtcoreError(f"{path} cannot be read ({e.strerror})", field=field,
                          fix="check the file and its permissions") from e  # fmt: skip
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise FtcoreError(f"{path} is not a regular file", field=field,
                          fix="point it at a file (not a directory, device or pipe)")  # fmt: skip
    return os.fdopen(fd, "rb")


def read_bytes(
    path: Path, field: str, *, root: Path | None = None, limit: int = MAX_READ_BYTES
) -> bytes:
    """The whole file (at most `limit` bytes: beyond that an FtcoreError, nothing more read)."""
    with open_read(path, field, root=root) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(size + 1) if size <= limit else b""  # read(n) allocates n bytes up front
    if size > limit or len(data) > limit:
        raise FtcoreError(f"{path} is larger than {limit} bytes, ftcore's limit for this file",
                          field=field, fix="check that it is the file meant here")  # fmt: skip
    return data


def read_text(
    path: Path, field: str, *, root: Path | None = None, limit: int = MAX_READ_BYTES
) -> str:
    data = read_bytes(path, field, root=root, limit=limit)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FtcoreError(f"{path} is not UTF-8 text (byte {e.start})", field=field,
                          fix="re-encode the file as UTF-8") from e  # fmt: skip


def entries(directory: Path, field: str, pattern: str = "*") -> list[Path]:
    """The files directly in `directory` matching `pattern`, sorted; each one inside it (a link
    leaving it is an FtcoreError, never followed)."""
    out = []
    for p in sorted(Path(directory).glob(pattern)):
        inside(directory, p.name, field, what=f"{directory} holds a link that")
        if p.is_file():
            out.append(p)
    return out


# ---------------------------------------------------------------------------------- writing


def create(path: Path, mode: int = 0o644) -> BinaryIO:
    """`path` as a new file open for writing: an old file, or a link left at its name, is
    removed first and never followed (O_EXCL | O_NOFOLLOW)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    return os.fdopen(fd, "wb")


def write_exclusive(path: Path, data: bytes) -> None:
    """Write `path` as a new file (`create`), fsync'd. For temporaries renamed into place."""
    with create(path) as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_atomic(path: Path, data: bytes | str) -> None:
    """`path` replaced whole: a new temporary `.<name>.tmp` beside it (`write_exclusive`), then a
    rename over the name (which replaces a link there, never writes through it)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    write_exclusive(tmp, data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def open_append(path: Path) -> TextIO:
    """`path` open for appending text, created if missing; a link at its name is refused (ELOOP)."""
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
        )
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise _linked(Path(path), "run.dir") from e
    return os.fdopen(fd, "a")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_file(src: Path, dst: Path, field: str, *, root: Path | None = None) -> None:
    """`src` (inside `root`, if given) copied, streamed, to the new file `dst` (`create`)."""
    with open_read(src, field, root=root) as f, create(dst) as out:
        shutil.copyfileobj(f, out, 1 << 23)


EXPORT_MARKER = ".ftcore_export"  # in every directory ftcore exports: export.overwrite needs it


def mark_export(directory: Path, what: str) -> None:
    """Mark `directory` (a model or adapter ftcore is writing) as ftcore's export."""
    write_exclusive(
        Path(directory) / EXPORT_MARKER, f'{{"written_by": "ftcore", "what": "{what}"}}\n'.encode()
    )


# ------------------------------------------------------------------------------ the run dir

RUN_SUBDIRS = ("checkpoints",)  # whose entries ftcore replaces and deletes too


def check_run_dir(run_dir: Path, field: str = "run.dir") -> None:
    """Refuse (exit 2) a run directory whose entries, or those of its checkpoints/, include a
    symbolic link: ftcore writes, replaces and deletes these names, and a link planted there (or
    kept by tar) would carry that to files elsewhere (another run's checkpoints, your own files)."""
    for d in (Path(run_dir), *(Path(run_dir) / s for s in RUN_SUBDIRS)):
        try:
            found = list(os.scandir(d))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in sorted(found, key=lambda e: e.name):
            if e.is_symlink():
                raise _linked(Path(e.path), field)


def _linked(path: Path, field: str) -> FtcoreError:
    return FtcoreError(
        f"{path} is a symbolic link: ftcore writes, replaces and deletes the files of a run "
        "directory, and never through a link",
        field=field,
        fix=f"remove the link {path} (put run.dir itself on the file system you want), or use a "
        "new run.dir",
    )
