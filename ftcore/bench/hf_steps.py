"""The Hugging Face side of bench/host_overhead: PEFT LoRA training steps of a tiny HF Llama.

A plain loop (forward, backward, gradient clipping, fused AdamW, zero_grad) over one fixed
micro-batch: what one training step of the Trainer runs, without the Trainer's own per-step work,
which does not grow with depth and so drops out of the per-layer figure the benchmark reports.
Run as `python -m ftcore.bench.hf_steps` with FTCORE_BENCH_SPEC naming {"out", "model_dir", "rows",
"seq_len", "warmup", "measure", "threads", "lora": {r, alpha, targets}}; it writes the result JSON.
"""

from __future__ import annotations

import time

from ftcore.bench.hf_recipe import lora_model
from ftcore.bench.runner import read_spec, write_result


def run_steps(spec: dict) -> dict:
    import torch

    torch.set_num_threads(int(spec.get("threads") or 1))
    torch.manual_seed(0)
    lora = spec["lora"]
    model = lora_model(spec["model_dir"], r=lora["r"], alpha=lora["alpha"], targets=lora["targets"])
    params = [p for p in model.parameters() if p.requires_grad]
    frozen = next(p for n, p in model.named_parameters() if "base_layer" in n)
    before = (frozen.detach().clone(), [p.detach().clone() for p in params])
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    rows, seq = int(spec["rows"]), int(spec["seq_len"])
    ids = torch.randint(0, model.config.vocab_size, (rows, seq))
    model.train()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    steps = []
    for i in range(int(spec["warmup"]) + int(spec["measure"])):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        steps.append({"warmup": i < int(spec["warmup"]), "step_time_s": time.perf_counter() - t0,
                      "cpu_s": time.process_time() - c0})  # fmt: skip
    moved = any(not torch.equal(a, p) for a, p in zip(before[1], params))
    return {"side": "hf", "steps": steps, "threads": torch.get_num_threads(),
            "trainable": sum(p.numel() for p in params), "adapters_moved": moved,
            "base_moved": not torch.equal(before[0], frozen)}  # fmt: skip


def main() -> int:
    spec = read_spec()
    write_result(spec, run_steps(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
