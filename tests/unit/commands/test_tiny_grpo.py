"""`python -m ftcore.train +exp=tiny_grpo`, shortened, as a user types it: the step line shows the
rollout's and the update's seconds apart and the reward, metrics.jsonl has TRL's names, the adapter
loads in PEFT and generates.
(The shipped 60 steps, whose reward rises, are measured in docs/grpo.md.)"""

from __future__ import annotations

import json
import re

from tests.support.cli import cli

SHORT = ["+exp=tiny_grpo", "train.max_steps=3", "train.global_batch_size=16",
         "train.micro_batch_size=8", "objective.num_generations=4"]  # fmt: skip


def test_tiny_grpo_trains_logs_trls_metrics_and_writes_a_peft_adapter(tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ftcore.config.schema import assets_dir

    run = tmp_path / "run"
    proc = cli("train", *SHORT, f"run.dir={run}", "logger.progress=lines")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [ln for ln in proc.stderr.splitlines() if re.search(r"step \d/3 \|", ln)]
    assert len(steps) == 3
    assert all(
        re.search(r"\(rollout [\d.]+ s, update [\d.]+ s\) \| reward [\d.]+$", s) for s in steps
    )
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for key in ("reward", "reward_std", "rewards/last_number/mean", "rewards/regex/std",
                "frac_reward_zero_std", "entropy", "clip_ratio/region_mean",
                "completions/mean_length", "completions/clipped_ratio", "rollout_time_s",
                "update_time_s"):  # fmt: skip
        assert all(key in r for r in records), key
    assert "kl" not in records[0]  # beta=0: TRL logs no kl
    base = AutoModelForCausalLM.from_pretrained(
        str(assets_dir() / "tiny_base"), dtype=torch.float32
    )
    model = PeftModel.from_pretrained(base, str(run / "hf_adapter")).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([[5, 9, 11]]), max_new_tokens=2, do_sample=False
        )
    assert out.shape == (1, 5)
