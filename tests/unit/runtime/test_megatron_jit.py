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


BUILD = """
import sys
from ftcore.runtime import megatron_jit
megatron_jit.install()
from ftcore.config.schema import compose
from ftcore.training import trainer
state = trainer.setup(compose(["+exp=tiny_lora", "model.allow_random_base=true", "eval.interval=0",
                               "checkpoint.interval=0", "run.dir=" + sys.argv[1], "model.init_path=null", "model.num_layers=2",
                               "model.hidden_size=64", "model.ffn_hidden_size=128", "data.seq_len=32",
                               "train.global_batch_size=2", "train.micro_batch_size=2",
                               "sched.warmup_steps=0"]))
state.optimizer.zero_grad()
sd = state.optimizer.state_dict()
print("torch._dynamo" in sys.modules)
before = [p.detach().clone() for p in state.optimizer.get_parameters()]
out = trainer.train_step(state)
moved = any(not a.equal(p) for a, p in zip(before, state.optimizer.get_parameters()))
print(moved and not out.get("skipped"), "torch._dynamo" in sys.modules, "transformers.models" in sys.modules)
from ftcore.peft.adapter_format import write_hf_adapter
print(write_hf_adapter(state).joinpath("adapter_config.json").is_file(), "peft" in sys.modules,
      "transformers.models" in sys.modules)
"""


def test_a_run_builds_its_optimizer_without_torch_dynamo(tmp_path):
    """torch's Optimizer methods import torch._dynamo only to mark themselves untraceable (~2 s of
    CPU); on the CPU runtime a run that builds, zeroes and saves an optimizer never loads it
    (ftcore.runtime.cpu.no_dynamo_wrappers), nor does its first step, whose torch wrapper would
    import it for a graph break (cpu.no_dynamo_step). Nor does loading the bundled tokenizer load
    transformers' index of model packages (~1.3 s: ftcore.data.tokenizer.from_directory), nor
    does writing the adapter import peft, which imports transformers' models (~2.5 s:
    ftcore.peft.adapter_config)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the CPU runtime's path")
    out = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], capture_output=True,
                         text=True, check=True)  # fmt: skip
    want = ["False", "True", "False", "False", "True", "False", "False"]
    assert out.stdout.split()[-7:] == want, out.stderr[-2000:]
