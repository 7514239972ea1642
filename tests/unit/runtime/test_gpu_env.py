"""runtime/gpu_env.py: the GPU workers' environment per GPU generation and overlap setting, the
user's own values kept, an outer launcher's choices redone for the inner config."""

from __future__ import annotations

from ftcore.config.schema import compose
from ftcore.runtime import gpu_env


def test_per_generation_and_overlap():
    h100 = gpu_env.gpu_env(compose(["+exp=70b_fp8"]))
    assert h100["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # Hopper, TP userbuffers: kernels in order
    assert h100["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert h100["TORCH_NCCL_HIGH_PRIORITY"] == "1" and h100["NVTE_FWD_LAYERNORM_SM_MARGIN"] == "20"
    assert "NCCL_P2P_NET_CHUNKSIZE" not in h100  # one node
    b200 = gpu_env.gpu_env(compose(["+exp=70b_full"]))
    assert b200["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"  # Blackwell
    plain = ["+exp=8b_lora", "parallel.overlap_grad_reduce=false"]
    assert "TORCH_NCCL_HIGH_PRIORITY" not in gpu_env.gpu_env(compose(plain))
    assert gpu_env.gpu_env(compose(plain))["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"  # TP=1
    multi = gpu_env.gpu_env(compose(["+exp=405b_full"]), nnodes=16)  # pp=16 over 16 nodes
    assert multi["NCCL_P2P_NET_CHUNKSIZE"] == "2097152"


def test_user_values_win_and_outer_choices_are_redone():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "mine"}
    gpu_env.apply(env, compose(["+exp=70b_fp8"]))
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "mine" and env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    # a benchmark configuration without overlap, launched from inside that worker's environment
    gpu_env.apply(env, compose(["+exp=70b_fp8", "parallel.tp=1", "parallel.sp=false",
                                "parallel.tp_comm_overlap=false",
                                "parallel.overlap_p2p_comm=false"]))  # fmt: skip
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
    assert "NVTE_FWD_LAYERNORM_SM_MARGIN" not in env
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "mine"


def test_a_plain_torchrun_process_gets_the_environment_first():
    """Issue 41, item 9: a rank started by plain torchrun (RANK, WORLD_SIZE, ... set; no ftcore
    launcher above it) sets the GPU environment itself, as the first thing it does: here on a
    machine without CUDA, before it exits 2 for the missing GPU."""
    import os
    import subprocess
    import sys

    from tests.support.cli import ROOT

    env = {
        k: v for k, v in os.environ.items() if k not in gpu_env.gpu_env(compose(["+exp=70b_fp8"]))
    }
    env.pop(gpu_env.AUTO, None)
    env.update(RANK="0", WORLD_SIZE="8", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8",
               MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", FTCORE_LOG_LEVEL="INFO")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "ftcore.train", "+exp=70b_fp8"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    at = [i for i, ln in enumerate(lines) if "GPU environment:" in ln]
    assert at, proc.stderr[-2000:]
    first = lines[at[0]]
    for kv in ("CUDA_DEVICE_MAX_CONNECTIONS=1", "NVTE_FWD_LAYERNORM_SM_MARGIN=20",
               "TORCH_NCCL_ASYNC_ERROR_HANDLING=3", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):  # fmt: skip
        assert kv in first, first
    assert at[0] < next(i for i, ln in enumerate(lines) if "no CUDA device" in ln)


def test_at_process_start_keeps_user_values_and_skips_cpu():
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "8", "WORLD_SIZE": "1"}
    got = gpu_env.at_process_start(compose(["+exp=70b_fp8"]), env)
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "8" and "CUDA_DEVICE_MAX_CONNECTIONS" not in got
    assert got["NVTE_BWD_LAYERNORM_SM_MARGIN"] == "20"
    assert gpu_env.at_process_start(compose(["+exp=tiny_lora"]), env := {}) == {} and env == {}


def image_env() -> dict[str, str]:
    """The variables the Dockerfile's ENV instructions set (its continued lines joined)."""
    import re
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parents[3] / "Dockerfile").read_text()
    env = {}
    for m in re.finditer(r"^ENV\s+((?:.*\\\n)*.*)$", text, re.M):
        for word in shlex.split(m.group(1).replace("\\\n", " ")):
            key, _, value = word.partition("=")
            env[key] = value
    return env


def test_the_image_leaves_ftcore_s_choices_to_ftcore():
    """Issue 50 item 7: a value already in the environment wins over ftcore's choice (a user's
    export must), so a variable the image sets would fix it for every config: the Dockerfile's
    CUDA_DEVICE_MAX_CONNECTIONS=1 kept the tp=1 and Blackwell value 32 from ever applying in
    ftcore's own image (the Kubernetes launcher overrides it: the two launchers differed)."""
    image = image_env()
    assert image.get("FTCORE_GPU_REQUIRE_TE") == "1" and "PYTHONUNBUFFERED" in image  # parsed
    chosen = set()
    for exp in (["+exp=70b_fp8"], ["+exp=70b_full"], ["+exp=8b_lora"], ["+exp=405b_full"]):
        chosen |= set(gpu_env.gpu_env(compose(exp), nnodes=16))
    assert chosen & set(image) == set()
    env = dict(image)
    gpu_env.apply(env, compose(["+exp=8b_lora"]))  # tp=1 on H100
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "32"
