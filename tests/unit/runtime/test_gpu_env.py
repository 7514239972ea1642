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
