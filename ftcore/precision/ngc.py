"""The NGC PyTorch image ftcore's Dockerfile builds on, and whether its Transformer Engine (TE) runs
every precision recipe shipped in conf/precision/.

An image's TE is fixed when NVIDIA builds it; a recipe newer than that TE exits 2 inside ftcore's
own container (issue 24: NVFP4 needs TE >= 2.7, the 25.06 image predates it). So the pin is
checked twice: against this table by a CPU test, and against the TE really installed when the
image is built (`python -m ftcore.precision.ngc`, the Dockerfile's last step).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from ftcore.config.schema import conf_dir


@dataclass(frozen=True)
class NgcImage:
    te: str  # Transformer Engine version inside the image
    cuda: float  # CUDA toolkit the image (and its torch) is built with
    torch: str
    python: str
    source: str  # where these versions come from


# nvcr.io/nvidia/pytorch:<tag>-py3. Add a row (with its source) before moving the Dockerfile's pin.
IMAGES: dict[str, NgcImage] = {
    "25.11": NgcImage(
        te="2.9",
        cuda=13.0,
        torch="2.10.0a0",
        python="3.12",
        source="NGC PyTorch release notes 25.11 (docs.nvidia.com/deeplearning/frameworks/"
        "pytorch-release-notes/rel-25-11.html); Megatron-Bridge moved its CI image from 25.09 to "
        "25.11 (commit b54b725, 2026-01-07)",
    ),
}

BASE_RE = re.compile(r"^ARG BASE_IMAGE=nvcr\.io/nvidia/pytorch:(\d\d\.\d\d)-py3\s*$", re.M)


def pinned_tag(dockerfile: Path) -> str:
    """The NGC PyTorch tag the Dockerfile's BASE_IMAGE default names."""
    m = BASE_RE.search(dockerfile.read_text())
    if not m:
        raise ValueError(f"{dockerfile}: no 'ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:YY.MM-py3' line")
    return m.group(1)


def shipped_recipes() -> dict[str, str]:
    """precision option (conf/precision/<name>.yaml) -> megatron recipe name, for FP8/FP4 ones."""
    out = {}
    for path in sorted((conf_dir() / "precision").glob("*.yaml")):
        p = OmegaConf.load(path)
        recipe = p.get("fp8_recipe") or p.get("fp4_recipe")
        if recipe:
            out[path.stem] = recipe
    return out


def too_new_for(te_version: str) -> list[str]:
    """The shipped precision options whose recipe needs a newer TE than `te_version`."""
    from packaging.version import Version

    from ftcore.precision.recipes import RECIPES

    return [
        f"{option} ({recipe}: TE >= {RECIPES[recipe].min_te})"
        for option, recipe in shipped_recipes().items()
        if Version(te_version) < Version(RECIPES[recipe].min_te)
    ]


def installed_te() -> str | None:
    """The installed Transformer Engine's version from its package metadata: importing TE needs
    the CUDA driver, which a `docker build` does not have."""
    from importlib import metadata

    for dist in ("transformer_engine", "transformer-engine", "transformer_engine_torch"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def main() -> int:
    """Inside the image being built: the installed TE runs every shipped recipe, or exit 1."""
    version = installed_te()
    if version is None:
        print(
            "ftcore.precision.ngc: Transformer Engine is not installed in this image",
            file=sys.stderr,
        )
        return 1
    missing = too_new_for(version)
    if missing:
        print(f"ftcore.precision.ngc: Transformer Engine {version} is too old for: {', '.join(missing)}",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"ftcore.precision.ngc: Transformer Engine {version} runs every recipe in conf/precision")
    return 0


if __name__ == "__main__":
    sys.exit(main())
