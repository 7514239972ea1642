"""ftcore's container runs every shipped recipe (issue 24, finding 7): the Dockerfile's NGC base is
in ftcore/precision/ngc.py's table, its Transformer Engine is new enough for every conf/precision recipe, and
the image requires TE (FTCORE_GPU_REQUIRE_TE=1) and checks the installed TE when it is built."""

from __future__ import annotations

import re
from pathlib import Path

from ftcore.precision import ngc
from ftcore.precision.recipes import RECIPES

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILE = ROOT / "Dockerfile"


def test_pinned_base_runs_every_shipped_recipe():
    tag = ngc.pinned_tag(DOCKERFILE)
    assert tag in ngc.IMAGES, (
        f"nvcr.io/nvidia/pytorch:{tag}-py3 has no row in ftcore/precision/ngc.py"
    )
    image = ngc.IMAGES[tag]
    assert ngc.too_new_for(image.te) == [], f"TE {image.te} of NGC {tag}"
    blockwise = RECIPES["blockwise"]
    assert image.cuda >= blockwise.min_cuda  # fp8_blockwise needs CUDA >= 12.9 too


def test_every_recipe_is_checked():
    """The table check sees every FP8/FP4 option of conf/precision, and can fail."""
    shipped = ngc.shipped_recipes()
    assert set(shipped.values()) == set(RECIPES), shipped
    assert any(s.startswith("nvfp4") for s in ngc.too_new_for("2.6.0"))  # what 25.06-era TE lacked
    assert ngc.too_new_for("2.7.0") == []


def test_image_requires_te_and_checks_it_at_build():
    text = DOCKERFILE.read_text()
    assert re.search(r"FTCORE_GPU_REQUIRE_TE=1", text)
    assert "python -m ftcore.precision.ngc" in text
