"""Issue 41's GPU confirmations (docs/gpu_path.md, "Second contact"): what the CPU proxies encode
from Transformer Engine's source, run where TE and two GPUs are. The resume with the distributed
optimizer (item 1) is test_runs_gpu.py's async save/resume case."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.gpu.cases import CASES
from tests.gpu.conftest import ROOT, need_gpus, need_runs, need_te, run_case
from tests.gpu.test_runs_gpu import learns

pytestmark = pytest.mark.gpu


def test_packed_rows_under_cp_run_with_p2p(runs):
    """Item 3: THD under CP=2 through TE's p2p ring (the one comm type validation lets through
    with packing) trains."""
    need_runs("cp2_packed_te")
    assert learns(runs("cp2_packed_te")["losses"])


def test_userbuffers_under_fp8_with_bf16_edge_layers(runs):
    """Item 4: TP=2 userbuffers registered in both modes (FP8 layers and the BF16 first/last
    ones each find theirs: 'UB for ... is not registered' otherwise); FP8 really runs."""
    need_runs("tp2_ub_fp8")
    got = runs("tp2_ub_fp8")
    assert got["fp8"]["fp8_modules"] > 0 and learns(got["losses"]), got


@pytest.mark.parametrize("mode", ["generate", "eval"])
def test_generation_and_accuracy_decode_on_an_fp8_userbuffer_experiment(tmp_path, mode):
    """Item 5: ftcore.generate and ftcore.eval eval.accuracy=true on an FP8 + userbuffer config
    decode (one token per row) in its derived BF16 form without userbuffers."""
    need_runs("tp2_ub_fp8")
    more = ["generate.prompt=What is 2 + 3?", "generate.max_new_tokens=4"]
    if mode == "eval":
        more = ["eval.accuracy=true", "eval.max_samples=4"]
    got = run_case(tmp_path, "tp2_ub_fp8", *more, mode=mode)
    assert got["cfg_precision"] == "bf16" and not got["tp_comm_overlap"], got
    if mode == "eval":
        assert "accuracy" in got["eval"], got


def train_cli(tmp_path, overrides, drop=(), env=None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node=1 -m ftcore.train ...`: a plain torchrun, no ftcore launcher;
    `drop`: variables left out of its environment; `env`: set in it (last)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "-m",
           "ftcore.train", *overrides, f"run.dir={tmp_path / 'run'}"]  # fmt: skip
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(PYTHONPATH=str(ROOT), FTCORE_LOG_LEVEL="INFO", **extra)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("name", ["fp32_te_packed", "cuda_graphs"])
def test_refused_before_anything_is_built(tmp_path, name):
    """Items 6 and 7 on the GPU itself: exit 2 naming the field, nothing written."""
    need_te()
    case = CASES[name]
    proc = train_cli(tmp_path, case.overrides())
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"ftcore error: {case.refused}:" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_te_has_no_fp32_attention_backend_for_packed_rows():
    """Item 6, TE's own rule that the refusal encodes: fp32 THD attention finds no backend."""
    need_te()
    need_gpus(1)
    import transformer_engine.pytorch as te

    heads, dim, lens = 4, 32, [40, 24]
    attn = te.DotProductAttention(heads, dim, attn_mask_type="padding_causal", qkv_format="thd")
    t = sum(lens)
    q, k, v = (torch.randn(t, heads, dim, device="cuda", dtype=torch.float32) for _ in range(3))
    cu = torch.tensor([0, lens[0], t], dtype=torch.int32, device="cuda")
    with pytest.raises(Exception, match="(?i)backend"):
        attn(q, k, v, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
             max_seqlen_kv=max(lens))  # fmt: skip


def test_a_plain_torchrun_gets_the_gpu_environment_before_cuda(tmp_path):
    """Item 9: `torchrun -m ftcore.train` with no ftcore launcher above it sets the GPU
    environment itself, before CUDA initialises (else it warns)."""
    need_runs("bf16_local")
    drop = ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "FTCORE_AUTO_ENV")
    proc = train_cli(tmp_path, [*CASES["bf16_local"].overrides(), "train.max_steps=2"], drop)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GPU environment:" in proc.stderr and "CUDA_DEVICE_MAX_CONNECTIONS=" in proc.stderr
    assert "after CUDA initialised" not in proc.stderr
