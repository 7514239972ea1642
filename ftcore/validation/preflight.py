"""What the user asked for, checked before anything is built (issue 31: nothing silently wrong).

- a GPU cluster on a machine without CUDA is refused first, in one line, with the way out;
- an adapter directory is never dropped: ftcore.generate and ftcore.eval use it (its
  adapter_config.json says it is LoRA, and which base it was trained on); ftcore.train refuses it
  next to full fine-tuning, since training a whole model and training an adapter save different
  things and take different learning rates;
- adapters on a random base are refused unless `model.allow_random_base=true`;
- every path the config names exists, so a typo in a data path costs seconds, not a 405B load.

Free of torch and megatron at import: this runs in the launching parent and in the SLURM dry run on
a login node (the one torch import, in require_cuda, is lazy).
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig

from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")


def require_cuda(cfg: DictConfig, entry: str) -> None:
    """train/eval/generate on a GPU cluster: refuse at once where no CUDA device is visible
    (otherwise a 70B model is built on CPU and dies minutes later with a traceback)."""
    if cfg.cluster.device != "cuda":
        return
    import torch  # lazy: the config checks run without torch

    if torch.cuda.is_available():
        return
    raise FtcoreError(
        f"no CUDA device was found on this machine, but cluster={cfg.cluster.name} runs "
        f"{cfg.run.exp} on GPUs",
        field="cluster",
        fix=f"here use cluster=local_cpu with a tiny model (python -m ftcore.{entry} "
        "+exp=tiny_lora), or submit the job to GPU nodes (sbatch slurm/<exp>.sh); "
        "python -m ftcore.plan plans it on this machine",
    )


def use_adapter(cfg: DictConfig, *, training: bool) -> DictConfig:
    """Make `peft.adapter_path` count: eval/generate load it as LoRA (r, alpha and targets come
    from its adapter_config.json) on the base it names when the config gives none; train refuses
    it next to peft=none (see check_adapter)."""
    p, m = cfg.peft, cfg.model
    if not p.adapter_path:
        return cfg
    if p.name == "none" and not training:
        log.info("peft.adapter_path given: loading %s as a LoRA adapter", p.adapter_path)
        p.name = "lora"
    if p.name != "none" and not (m.hf_path or m.init_path):
        base = _adapter_base(p.adapter_path)
        if base is not None:
            key, value = base
            log.info("no base model given: using the adapter's base, model.%s=%s", key, value)
            m[key] = value
    return cfg


def _adapter_base(adapter: str) -> tuple[str, str] | None:
    """("hf_path", DIR) or ("init_path", NAME of a bundled base) from the adapter's
    base_model_name_or_path, when that resolves here; None otherwise (a Hub name is not fetched)."""
    from ftcore.config.schema import assets_dir
    from ftcore.peft.config import read_adapter_config

    base = read_adapter_config(adapter).get("base_model_name_or_path")
    if not base:
        return None
    path = Path(base)  # only an absolute path: a relative one would resolve against the cwd
    bundled = path.is_absolute() and path.parent.resolve() == assets_dir().resolve()
    if bundled and (path / "config.json").is_file():
        return "init_path", path.name  # a bundled base, written as its absolute path
    if path.is_absolute() and (path / "config.json").is_file():
        return "hf_path", str(path)
    if (assets_dir() / base).is_dir() and "/" not in base:
        return "init_path", base
    return None


def check_inputs(cfg: DictConfig) -> None:
    """validate()'s first step: the paths, the adapter and the base weights."""
    check_paths(cfg)
    check_adapter(cfg)
    check_base(cfg)


def check_paths(cfg: DictConfig) -> None:
    """Every path the config names exists (the data, the model, the tokenizer, the adapter, the
    checkpoint to resume from), named by its field."""
    from ftcore.config.schema import assets_dir
    from ftcore.data.sources import resolve
    from ftcore.peft.config import read_adapter_config

    d, m, resume = cfg.data, cfg.model, cfg.checkpoint.resume
    data = [("data.path", d.path), ("data.val_path", d.val_path)]
    data += [(f"data.mix[{i}].path", entry.path) for i, entry in enumerate(d.mix)]
    for field, path in data:
        if path:
            resolve(path, field)  # a file, a directory of them, or a dataset in the HF cache
    directories = [
        ("model.hf_path", m.hf_path, "a local Hugging Face model directory (config.json, *.safetensors)"),
        ("model.init_path", m.init_path, "a model directory, or a bundled base (tiny_base)"),
        ("model.tokenizer", m.tokenizer, "a Hugging Face tokenizer directory"),
        ("peft.adapter_path", cfg.peft.adapter_path, "a PEFT adapter directory (a run's hf_adapter/)"),
        ("checkpoint.resume", None if resume in ("auto", "never") else resume,
         "a step_<N> checkpoint directory, auto or never"),
    ]  # fmt: skip
    for field, path, what in directories:
        if not path or Path(path).expanduser().is_dir():
            continue
        if field == "model.init_path" and (assets_dir() / path).is_dir():
            continue  # a bundled base, named relative to ftcore/assets
        state = "is not a directory" if Path(path).expanduser().exists() else "does not exist"
        raise FtcoreError(f"{path} {state}", field=field, fix=f"give {what}")
    if cfg.peft.adapter_path:
        read_adapter_config(cfg.peft.adapter_path)  # its adapter_config.json is there and readable


def check_adapter(cfg: DictConfig) -> None:
    """An adapter next to peft=none is a contradiction the user made (eval/generate resolved it
    already, see use_adapter): refuse it rather than drop the path."""
    p = cfg.peft
    if p.adapter_path and p.name == "none":
        raise FtcoreError(
            f"an adapter is given ({p.adapter_path}) but peft.name=none fine-tunes the whole model",
            field="peft.adapter_path",
            fix="add peft=lora to go on training that adapter, or drop peft.adapter_path "
            "for full fine-tuning",
        )


def check_base(cfg: DictConfig) -> None:
    """Adapters learn a correction to a pretrained base: on random weights they learn nothing
    worth keeping, so that needs saying (benchmarks and tests that need no real weights do)."""
    m = cfg.model
    if cfg.peft.name == "none" or m.hf_path or m.init_path or m.allow_random_base:
        return
    named = ""
    if cfg.peft.adapter_path:  # use_adapter found no base it names here: say which it names
        from ftcore.peft.config import read_adapter_config

        base = read_adapter_config(cfg.peft.adapter_path).get("base_model_name_or_path")
        named = f"; the adapter names the base {base!r}, which is no directory here" if base else ""
    raise FtcoreError(
        f"peft={cfg.peft.name} puts adapters on a frozen base model, but no base weights are "
        f"given (model.hf_path and model.init_path are unset), so the base would be random{named}",
        field="model.hf_path",
        fix="model.hf_path=DIR (the base model's Hugging Face directory), or "
        "model.allow_random_base=true for a benchmark or test that needs no real weights",
    )


def check_target_hardware(cfg: DictConfig) -> None:
    """The hardware check against the target cluster (cluster.compute_capability), for a login
    node without its GPUs: the SLURM dry run. Transformer Engine's own verdict waits for the job."""
    from ftcore.precision import hardware, recipes

    c = cfg.cluster
    if c.device != "cuda" or c.compute_capability is None:
        hardware.check_hardware(cfg)  # a CPU cluster runs where it is checked
        return
    recipes.check_config(cfg)
    recipes.check_te_attention(cfg)  # ftcore's image has TE
    name, cc = recipes.recipe_name(cfg), float(c.compute_capability)
    if name is None:
        if cfg.precision.params_dtype == "bf16" and cc < 8.0:
            raise FtcoreError(f"BF16 needs compute capability >= 8.0; {c.name} has {cc:.1f}",
                              field="precision", fix="use precision=fp32")  # fmt: skip
        return
    ok, why = hardware.supported_on(name, cc)
    if not ok:
        raise FtcoreError(f"{cfg.precision.name} {why.replace('this GPU', c.name)}", field="precision",
                          fix=f"use precision={hardware.fallback(cc, cfg.precision.name)} on {c.name}")  # fmt: skip
