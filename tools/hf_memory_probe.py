"""Peak host memory per rank while loading an HF checkpoint (README "Hugging Face checkpoints").

    python tools/hf_memory_probe.py make DIR            # a random ~620 MB fp32 Llama (155M params)
    python -m torch.distributed.run --nproc_per_node=4 tools/hf_memory_probe.py load DIR 2 2

Each rank resets its peak-RSS counter (/proc/self/clear_refs), builds its chunks (megatron allocates
the parameters), resets it again and loads its shards; it prints its shard bytes and the peak RSS
above the pre-build baseline in each phase (anonymous and file-backed pages both count, so the
memory-mapped reads are included).
"""

from __future__ import annotations

import json
import os
import sys


def make(path: str) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from ftcore.data.tokenizer import bundled_tokenizer_dir

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=2048,
                         rms_norm_eps=1e-5)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    model.save_pretrained(path, max_shard_size="200MB")
    AutoTokenizer.from_pretrained(
        str(bundled_tokenizer_dir()), trust_remote_code=False
    ).save_pretrained(path)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters -> {path}")


def load(path: str, tp: int, pp: int) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftcore.config.schema import compose
    from ftcore.hf.config import merge_hf_config
    from ftcore.hf.io import load_weights
    from ftcore.models.builder import build_model
    from ftcore.runtime import cpu
    from ftcore.runtime.host_memory import reset_peak, status

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    cpu.activate()
    cfg = merge_hf_config(
        compose([f"model.hf_path={path}", f"parallel.tp={tp}", f"parallel.pp={pp}"])
    )
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    reset_peak()
    base = status("VmRSS")
    chunks = build_model(cfg)
    build_peak, built = status("VmHWM") - base, status("VmRSS") - base
    reset_peak()
    load_weights(cfg, chunks)
    load_peak = status("VmHWM") - base
    shard = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    mb = lambda b: round(b / 2**20, 1)  # noqa: E731
    row = {"rank": dist.get_rank(), "tp": tp, "pp": pp, "shard_mb": mb(shard), "build_peak_mb": mb(build_peak),
           "after_build_mb": mb(built), "load_peak_mb": mb(load_peak),
           "load_adds_mb": mb(load_peak - built), "peak_over_shard": round(max(build_peak, load_peak) / shard, 2)}  # fmt: skip
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, row)
    if dist.get_rank() == 0:
        for r in rows:
            print(json.dumps(r))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if sys.argv[1] == "make":
        make(sys.argv[2])
    else:
        load(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
