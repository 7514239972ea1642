"""`python -m ftcore.export export.checkpoint=DIR [export.output=DIR] [export.dtype=bf16]`: a
checkpoint of any layout -> a Hugging Face model directory, in one process, one tensor at a time.

DIR is a `checkpoints/step_<N>` directory, a `checkpoints/` directory (its `latest`) or a run
directory. The model's shapes and tokenizer come from the run's `config.yaml`. The output defaults
to `<run.dir>/hf_model`. A LoRA run's (adapter-only) checkpoint goes to ftcore.peft.merge:
`hf_adapter/`, or with `export.merge=true` the merged model streamed from the run's base.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ftcore.cli import run
from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")


def resolve_step_dir(path: str) -> Path:
    p = Path(path).expanduser()
    for root in (p, p / "checkpoints"):
        if (root / ".metadata").is_file():
            return root
        latest = root / "latest"
        if latest.is_file() or latest.is_symlink():
            step = safe_files.read_latest(root, "export.checkpoint")  # exactly step_<N>, here
            if (step / ".metadata").is_file():
                return step
            raise FtcoreError(
                f"{latest} points at {step}, which is not a complete checkpoint",
                field="export.checkpoint",
                fix="export.checkpoint=<run.dir>/checkpoints/step_<N> of a finished save",
            )
    raise FtcoreError(f"no checkpoint at {p}", field="export.checkpoint",
                      fix="point it at <run.dir>/checkpoints/step_<N>, <run.dir>/checkpoints or <run.dir>")  # fmt: skip


def run_config(step_dir: Path) -> DictConfig:
    """The run's config: the copy saved with the checkpoint, else <run.dir>/config.yaml. Data
    from elsewhere: no interpolation is resolved (an `${oc.env:...}` would put your secrets into
    config.json), checked against the schema."""
    for f in (step_dir / "config.yaml", step_dir.parent.parent / "config.yaml"):
        if f.is_file() or f.is_symlink():
            return safe_files.read_run_config(f, "export.checkpoint", root=f.parent)
    raise FtcoreError(f"no config.yaml next to {step_dir} (nor in its run directory)", field="export.checkpoint",
                      fix="export needs the run's config.yaml for the model shapes and tokenizer")  # fmt: skip


def merge_transform(cfg: DictConfig, run_cfg: DictConfig, step_dir: Path):
    """export.merge=true: fold LoRA adapters into the base weights (provided by ftcore.peft)."""
    if not cfg.export.merge:
        return None
    from ftcore.precision.recipes import check_merge

    check_merge(run_cfg)  # an FP8/FP4-trained base would round the low-rank update away
    try:
        from ftcore.peft.merge import merge_transform as peft_merge
    except ImportError as e:
        raise FtcoreError(
            "export.merge needs ftcore.peft.merge.merge_transform",
            field="export.merge",
            fix="reinstall ftcore (pip install -e .), or export.merge=false",
        ) from e
    return peft_merge(cfg, run_cfg, step_dir)


def task(cfg: DictConfig) -> int | None:
    from ftcore.config.ranges import check_ranges
    from ftcore.hf.export import export_checkpoint

    check_ranges(cfg)
    from ftcore.hf.export import DTYPES

    if cfg.export.dtype and cfg.export.dtype not in (*DTYPES, "fp8"):
        raise FtcoreError(f"export.dtype={cfg.export.dtype} is not one of "
                          f"{', '.join((*DTYPES, 'fp8'))}", field="export.dtype",
                          fix="export.dtype=bf16 (or fp8: DeepSeek's FP8 block format)")  # fmt: skip
    if not cfg.export.checkpoint:
        raise FtcoreError("no checkpoint given", field="export.checkpoint",
                          fix="export.checkpoint=<run.dir>/checkpoints/step_<N>")  # fmt: skip
    step_dir = resolve_step_dir(cfg.export.checkpoint)
    from ftcore.checkpoint.files import check_manifest

    check_manifest(step_dir, checksums=True, field="export.checkpoint")  # as resume checks it
    run_cfg = run_config(step_dir)
    run_dir = step_dir.parent.parent
    adapter = run_cfg.peft.get("name", "none") != "none"  # LoRA checkpoints hold the adapters only
    from ftcore.data.tokenizer import tokenizer_source

    tok, _ = tokenizer_source(run_cfg)  # checked before anything is written; never downloaded
    if not adapter and not Path(tok).expanduser().is_dir():
        raise FtcoreError(f"the run's tokenizer {tok} (model.tokenizer / model.hf_path in its "
                          "config.yaml) is not a local directory", field="export.checkpoint",
                          fix="export where the run's tokenizer directory exists")  # fmt: skip
    default = run_dir / ("hf_adapter" if adapter and not cfg.export.merge else "hf_model")
    out = Path(cfg.export.output or default)
    check_output(out, cfg.export.overwrite)
    if adapter:
        from ftcore.peft.merge import export_adapter_checkpoint

        export_adapter_checkpoint(step_dir, run_cfg, str(out), merge=cfg.export.merge)
    else:
        export_checkpoint(step_dir, run_cfg, str(out), dtype=cfg.export.dtype, max_shard_gb=cfg.export.max_shard_gb,
                          transform=merge_transform(cfg, run_cfg, step_dir))  # fmt: skip
    what = "PEFT adapter" if adapter and not cfg.export.merge else "Hugging Face model"
    log.info("wrote the %s of %s to %s", what, step_dir, out)
    return None


def is_export(out: Path) -> bool:
    """An empty directory, or one that carries ftcore's export marker (safe_files.EXPORT_MARKER,
    written into every model and adapter directory ftcore exports), not through a link."""
    if out.is_symlink() or not out.is_dir():
        return False
    marker = out / safe_files.EXPORT_MARKER
    return not any(out.iterdir()) or (marker.is_file() and not marker.is_symlink())


def check_output(out: Path, overwrite: bool) -> None:
    """An existing export (e.g. the hf_model/ a run wrote at its end) is replaced only when asked,
    and only when ftcore wrote it: export.overwrite never removes a directory it did not write
    (a Hugging Face model you copied there, notes beside it)."""
    if not (out.exists() or out.is_symlink()):
        return
    if not overwrite:
        raise FtcoreError(f"{out} already exists", field="export.output",
                          fix="export.output=NEW_DIR, or export.overwrite=true to replace it")  # fmt: skip
    if not is_export(out):
        raise FtcoreError(
            f"{out} holds no previous export (no {safe_files.EXPORT_MARKER}, the marker ftcore writes into each "
            "export): export.overwrite replaces only what ftcore exported, it is left untouched",
            field="export.output",
            fix="export.output=NEW_DIR (a new or empty directory, or an earlier ftcore export)",
        )


if __name__ == "__main__":
    run("export", task)
