"""The one door for files that came from elsewhere: checkpoints, model and adapter directories,
data, caches, run directories. They are data, never code, and are read only where they are.

Every read of such a file in ftcore goes through a function here (tests/unit/runtime/
test_one_door.py fails on a direct `open`, `torch.load`, `OmegaConf.load`, safetensors read, ...
anywhere else, but for a short allow-list of files ftcore wrote itself or ships):

- paths (paths.py): `inside` (a name from a file stays in its directory: no absolute path, no
  `..`, no link leaving it), `open_read`/`read_bytes`/`read_text` (O_NOFOLLOW on the resolved
  path, a regular file, bounded), `entries`; writes that never follow a link: `create`,
  `write_exclusive` (O_EXCL | O_NOFOLLOW), `write_atomic` (that, then rename), `open_append`,
  `copy_file`; `check_run_dir` (no link among a run directory's entries); `mark_export` /
  `EXPORT_MARKER` (what export.overwrite may replace).
- contents (parse.py): `read_json` (any parse error is an FtcoreError), `read_run_config` /
  `run_config` (YAML as data, no interpolation, checked against the schema), `torch_load` /
  `load_tensors` (weights_only=True, explicit), `safetensors_open` / `load_safetensors`,
  `tokenizer` (local, no remote code).
- checkpoints (checkpoint.py): `read_metadata` (restricted unpickler, storage confined),
  `reader`, `megatron_readers()` (megatron's load: `.metadata`, byte items, TE's FP8 state,
  common.pt), `read_common`, `check_extra_state`, `read_latest`.

docs/checkpoints.md lists what each guarantees and what stays out of scope.
"""

from ftcore.runtime.safe_files.checkpoint import (
    check_extra_state,
    megatron_readers,
    read_common,
    read_latest,
    read_metadata,
    reader,
)
from ftcore.runtime.safe_files.parse import (
    load_safetensors,
    load_tensors,
    parse_json,
    read_json,
    read_json_object,
    read_run_config,
    run_config,
    safetensors_open,
    tokenizer,
    torch_load,
)
from ftcore.runtime.safe_files.paths import (
    EXPORT_MARKER,
    MAX_READ_BYTES,
    check_run_dir,
    copy_file,
    create,
    entries,
    fsync_dir,
    inside,
    mark_export,
    open_append,
    open_read,
    read_bytes,
    read_text,
    write_atomic,
    write_exclusive,
)

__all__ = [
    "EXPORT_MARKER",
    "MAX_READ_BYTES",
    "check_extra_state",
    "check_run_dir",
    "copy_file",
    "create",
    "entries",
    "fsync_dir",
    "inside",
    "load_safetensors",
    "load_tensors",
    "mark_export",
    "megatron_readers",
    "open_append",
    "open_read",
    "parse_json",
    "read_bytes",
    "read_common",
    "read_json",
    "read_json_object",
    "read_latest",
    "read_metadata",
    "read_run_config",
    "read_text",
    "reader",
    "run_config",
    "safetensors_open",
    "tokenizer",
    "torch_load",
    "write_atomic",
    "write_exclusive",
]
