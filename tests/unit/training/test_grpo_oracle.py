"""TRL is the oracle of GRPO (issue 55): on a random tiny HF model with a random LoRA adapter, the
same prompts, the same fixed completions (TRL's `_generate_single_turn` and ftcore's
`rollout.sample` both replaced by them, nothing else) and the same reward functions, two steps of
ftcore's objective=grpo give TRL 1.16 GRPOTrainer's losses and logged metrics to 1e-5 and the
same adapter after the updates, for every loss_type, with and without beta, with
num_iterations 1 and 2 (the second step reuses the rollout, its old log-probs and clipping), and
with scale_rewards, epsilon_high and mask_truncated_completions varied. Adam with a large eps
makes each update proportional to the gradient, so the adapters compare the gradients too."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.hf_helpers import make_tiny_hf
from tests.support.tiny import TINY

PROMPTS = [{"prompt": "What is 2 + 3?", "answer": "5"}, {"prompt": "What is 4 + 5?", "answer": "9"}]
EOS = 2033  # make_tiny_hf's <|end_of_text|>
FIXED = [  # per prompt, num_generations=4 completions: stopped (EOS kept) or cut at 6 tokens
    [[101, 250, 33, EOS], [400, 41, 512, 77, 90, 66], [17, EOS], [803, 804, 805, 806, 807, 808]],
    [[221, 19, EOS], [1000, 1200, 37, 38, EOS], [56, 57, 58, 59, 60, 61], [47, EOS]],
]
REWARDS = "tests.support.grpo_rewards"
LR, EPS, TEMPERATURE = 0.05, 1e-2, 0.9  # eps >> |g|: Adam's first step ~ lr * g / eps
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]
COMBOS = {  # name: GRPO settings (TRL's names); bnpo with one micro-batch (TRL's local batch)
    "grpo": dict(loss_type="grpo", beta=0.0, num_iterations=1),
    "grpo-beta": dict(loss_type="grpo", beta=0.04, num_iterations=1),
    "grpo-mu2": dict(loss_type="grpo", beta=0.0, num_iterations=2),
    "grpo-beta-mu2": dict(loss_type="grpo", beta=0.04, num_iterations=2),
    "dapo": dict(loss_type="dapo", beta=0.0, num_iterations=1),
    "dapo-beta-mu2": dict(loss_type="dapo", beta=0.04, num_iterations=2, epsilon_high=0.28,
                          mask_truncated_completions=True),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.0, num_iterations=1),
    "dr_grpo-beta-mu2": dict(loss_type="dr_grpo", beta=0.04, num_iterations=2, scale_rewards="none",
                             use_bias_correction_kl=False),
    "bnpo": dict(loss_type="bnpo", beta=0.0, num_iterations=1),
    "bnpo-beta-mu2": dict(loss_type="bnpo", beta=0.04, num_iterations=2, scale_rewards="batch"),
}  # fmt: skip
KEYS = ("loss", "reward", "reward_std", "frac_reward_zero_std", "rewards/length_reward/mean",
        "rewards/length_reward/std", "rewards/picky_reward/mean", "rewards/picky_reward/std",
        "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
        "clip_ratio/low_min", "clip_ratio/high_max", "completions/mean_length",
        "completions/clipped_ratio", "completions/mean_terminated_length")  # fmt: skip


def _overrides(hf_dir: str, adapter: str, data: str, run_dir: str, combo: dict) -> list[str]:
    mbs = 8 if combo["loss_type"] == "bnpo" else 4
    over = [*TINY, f"model.hf_path={hf_dir}", f"run.dir={run_dir}", "objective=grpo",
            f"data.path={data}", "data.seq_len=24", "data.packing=false", "train.global_batch_size=8",
            f"train.micro_batch_size={mbs}", "objective.num_generations=4",
            "objective.max_completion_length=6", f"objective.temperature={TEMPERATURE}",
            f"objective.rewards=[{{fn: '{REWARDS}:length_reward'}}, "
            f"{{fn: '{REWARDS}:picky_reward', weight: 0.5}}]",
            "peft=lora", "peft.r=4", "peft.lora_alpha=8", f"peft.adapter_path={adapter}",
            f"peft.target_modules=[{','.join(TARGETS)}]", f"optim.lr={LR}", f"optim.eps={EPS}",
            "optim.betas=[0.9,0.999]", "optim.weight_decay=0.0", "train.grad_clip=0",
            "sched.name=constant", "sched.warmup_steps=0", "train.max_steps=2"]  # fmt: skip
    return over + [f"objective.{k}={v}" for k, v in combo.items()]


def ftcore_case(hf_dir: str, adapter: str, data: str, root: str) -> dict:
    """Worker: two steps of every combo, each from the same adapter with a fresh optimizer; the
    losses, the metrics and the adapter's tensors after them. Sampling is replaced by the fixed
    completions. One setup serves every combo (its settings are read at each step): the adapter is
    put back, the optimizer, schedule and prompt stream built anew, the reference kept for beta."""
    from ftcore.training.objectives.grpo import rollout

    by_prompt = {tuple(p): FIXED[i] for i, p in enumerate(_trl_prompt_ids(hf_dir))}
    seen: list = []

    def fixed(state, prompt_rows, rows, index):
        g = state.cfg.objective.num_generations
        seen.extend(tuple(p) for p in prompt_rows)
        return [list(by_prompt[tuple(p)][k % g]) for p, k in zip(prompt_rows, rows)]

    original, rollout.sample = rollout.sample, fixed  # the pool's worker lives on: put it back
    try:
        return _combos(hf_dir, adapter, data, root, seen)
    finally:
        rollout.sample = original


def _combos(hf_dir: str, adapter: str, data: str, root: str, seen: list) -> dict:
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from ftcore.config.schema import compose
    from ftcore.peft.adapter_format import write_hf_adapter
    from ftcore.peft.reference import snapshot
    from ftcore.training import optim, trainer

    first = {"loss_type": "grpo", "beta": 0.04, "num_iterations": 1}  # builds the reference
    state = trainer.setup(compose(_overrides(hf_dir, adapter, data, str(Path(root, "run")), first)))
    chunks = [m.module for m in state.model]
    start, reference, stream = snapshot(chunks), state.extra["reference"], state.loader.state_dict()
    out = {}
    for name, combo in COMBOS.items():
        cfg = compose(_overrides(hf_dir, adapter, data, str(Path(root, name)), combo))
        state.cfg = cfg
        for n, p in _adapter(chunks):
            p.data.copy_(start[n])
        state.optimizer = optim.build_optimizer(cfg, state.model)
        state.scheduler = optim.build_scheduler(cfg, state.optimizer)
        trainer._wire_model_config(state)
        state.loader.load_state_dict(stream)
        state.step, state.run_dir = 0, Path(cfg.run.dir)
        state.extra["grpo_batch"] = None
        state.extra["reference"] = reference if combo["beta"] else None
        steps = []
        for _ in range(2):
            r = trainer.train_step(state)
            state.step += 1
            steps.append({"loss": r["loss"], **r["metrics"]})
        weights = load_file(str(write_hf_adapter(state) / "adapter_model.safetensors"))
        out[name] = {"steps": steps, "adapter": {k: v.tolist() for k, v in weights.items()}}
    ps.destroy_model_parallel()
    out["prompt_ids"] = sorted(set(seen))
    return out


def _adapter(chunks) -> list:
    from ftcore.models.sharding import iter_params

    return [(n, p) for n, p in iter_params(chunks) if ".lora_A." in n or ".lora_B." in n]


def _trl_prompt_ids(hf_dir: str) -> list[list[int]]:
    """The prompts as TRL tokenizes standard prompts (`processing_class(text=prompts)`)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    return [tok(p["prompt"])["input_ids"] for p in PROMPTS]


def trl_run(hf_dir: str, adapter: str, combo: dict, out: Path) -> dict:
    """TRL's GRPOTrainer for two steps with its generation replaced by FIXED."""
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from tests.support import grpo_rewards

    tok = AutoTokenizer.from_pretrained(hf_dir)
    ids = {tuple(p): FIXED[i] for i, p in enumerate(_trl_prompt_ids(hf_dir))}
    seen: list = []

    def fixed(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        counts: dict = {}
        completions = []
        for p in prompt_ids:
            k = counts[tuple(p)] = counts.get(tuple(p), -1) + 1
            seen.append(tuple(p))
            completions.append(list(ids[tuple(p)][k]))
        return completions, None

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter, is_trainable=True)
    args = GRPOConfig(output_dir=str(out), per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=6, temperature=TEMPERATURE, use_cpu=True, bf16=False,
                      report_to=[], max_steps=2, logging_steps=1, shuffle_dataset=False,
                      learning_rate=LR, adam_epsilon=EPS, adam_beta1=0.9, adam_beta2=0.999,
                      weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                      optim="adamw_torch", gradient_checkpointing=False, save_strategy="no",
                      disable_tqdm=True, reward_weights=[1.0, 0.5], **combo)  # fmt: skip
    trainer = GRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(PROMPTS),
                          reward_funcs=[grpo_rewards.length_reward, grpo_rewards.picky_reward],
                          processing_class=tok)  # fmt: skip
    original = GRPOTrainer._generate_single_turn
    GRPOTrainer._generate_single_turn = fixed
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend for the cores
    try:
        trainer.train()
    finally:
        GRPOTrainer._generate_single_turn = original
        torch.set_num_threads(threads)
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_loss" not in h]
    weights = {k.replace(".default", ""): v.detach().tolist() for k, v in model.state_dict().items()
               if ".lora_" in k and ".default." in k}  # fmt: skip
    return {"steps": logs, "adapter": weights, "prompt_ids": sorted(set(seen))}


@pytest.fixture(scope="module")
def runs(pool1, tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model

    from tests.support.hf_helpers import hf_model

    root = tmp_path_factory.mktemp("grpo_oracle")
    hf_dir = str(make_tiny_hf(root / "base"))
    torch.manual_seed(3)
    peft_model = get_peft_model(hf_model(hf_dir), LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False))  # fmt: skip
    adapter = str(root / "adapter")
    peft_model.save_pretrained(adapter)
    data = root / "prompts.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    ours = pool1.run(ftcore_case, hf_dir, adapter, str(data), str(root / "ftcore"))[0]
    return hf_dir, adapter, ours, root


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-6)


@pytest.mark.parametrize("name", list(COMBOS))
def test_ftcore_grpo_steps_are_trls(runs, name):
    hf_dir, adapter, ours, root = runs
    want = trl_run(hf_dir, adapter, COMBOS[name], root / f"trl_{name}")
    assert ours["prompt_ids"] == want["prompt_ids"]  # the prompts tokenized alike
    got = ours[name]
    assert len(want["steps"]) == len(got["steps"]) == 2
    for step, (g, w) in enumerate(zip(got["steps"], want["steps"]), start=1):
        keys = [k for k in KEYS if k in w]
        assert "loss" in keys and "entropy" in keys
        missing = [k for k in keys if k not in g]
        assert not missing, (step, missing)
        bad = {k: (g[k], w[k]) for k in keys if not _close(g[k], w[k])}
        assert not bad, (name, step, bad)
    assert set(got["adapter"]) == set(want["adapter"])
    start = _start_adapter(adapter)
    for k, w in want["adapter"].items():
        import torch

        g, w, s = torch.tensor(got["adapter"][k]), torch.tensor(w), start[k]
        moved = (w - s).abs().max().item()
        assert moved > 1e-4, (k, "the update did not move it: the comparison proves nothing")
        assert (g - w).abs().max().item() <= 1e-5 * max(1.0, moved) + 1e-6, (name, k)


def _start_adapter(adapter: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(str(Path(adapter, "adapter_model.safetensors"))).items()}
