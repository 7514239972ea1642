"""On a machine without CUDA, ftcore's entry points import megatron-core without torch.compile
(ftcore/runtime/megatron_jit.py): the fused functions stay plain, torch._dynamo is never loaded."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from ftcore.runtime import megatron_jit
megatron_jit.install()
from megatron.core.models.gpt import GPTModel
from megatron.core.fusions import fused_bias_swiglu
from megatron.core.jit import jit_fuser
print(jit_fuser.__name__, "torch._dynamo" in sys.modules, megatron_jit._Finder not in map(type, sys.meta_path))
"""


def test_megatron_imports_without_torch_compile():
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA megatron keeps torch.compile")
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["noop_decorator", "False", "True"], out.stderr[-2000:]
