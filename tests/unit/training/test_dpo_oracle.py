"""TRL is the oracle of DPO (issue 44): on a random tiny HF model, a LoRA DPO run writes an adapter,
and `ftcore.eval objective=dpo` with it gives what TRL's `DPOTrainer.evaluate` gives for the same
adapter (policy: base + adapter through PEFT; reference: the base; one pair per batch, so every
value is a mean over pairs) to 1e-5, for sigmoid, ipo and sigmoid + sft, on standard and
conversational records. One training run and one ftcore evaluation per record shape, shared."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.support.hf_helpers import make_tiny_hf
from tests.support.tiny import TINY

LOSSES = {"sigmoid": ["sigmoid"], "ipo": ["ipo"], "sigmoid+sft": ["sigmoid", "sft"]}
KEYS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected")
WORDS = ["plum", "mirror", "feather", "street", "carpet", "star", "seven", "blue", "river"]


def _records(n: int, conversational: bool, seed: int) -> list[dict]:
    """Pairs of varied lengths; conversational ones as TRL's message lists."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = f"Q{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 6)))
        chosen = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5)))
        rejected = " " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 7))) + " no"
        if conversational:
            out.append({"prompt": [{"role": "user", "content": prompt}],
                        "chosen": [{"role": "assistant", "content": chosen.strip()}],
                        "rejected": [{"role": "assistant", "content": rejected.strip()}]})  # fmt: skip
        else:
            out.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return out


def _write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _cfg(hf_dir: str, run_dir: str, data: str, *over: str):
    from ftcore.config.schema import compose

    return compose([*TINY, f"model.hf_path={hf_dir}", f"run.dir={run_dir}", "peft=lora",
                    "peft.r=4", "peft.lora_alpha=8", "objective=dpo", "data.format=preference",
                    f"data.path={data}", "data.seq_len=64", *over])  # fmt: skip


def train_case(hf_dir: str, run_dir: str, data: str) -> str:
    """Worker: a few LoRA DPO steps; the adapter directory."""
    from ftcore.training import trainer

    cfg = _cfg(hf_dir, run_dir, data, "train.max_steps=3", "train.global_batch_size=4",
               "optim.lr=2e-2", "sched.warmup_steps=0")  # fmt: skip
    state = trainer.setup(cfg)
    trainer.fit(state)
    return str(Path(run_dir) / "hf_adapter")


def eval_case(hf_dir: str, run_dir: str, data: str, adapter: str, pairs: int) -> dict:
    """Worker: ftcore.eval's evaluation under objective=dpo, one setup, each loss in turn."""
    from ftcore import eval as ftcore_eval
    from ftcore.training import trainer
    from ftcore.validation import preflight

    cfg = _cfg(hf_dir, run_dir, data, f"peft.adapter_path={adapter}",
               f"train.global_batch_size={pairs}", "train.micro_batch_size=1")  # fmt: skip
    preflight.use_adapter(cfg, training=False)
    state = trainer.setup(cfg, data=False, kind="eval")
    out = {}
    for name, types in LOSSES.items():
        state.cfg.objective.loss_type = types
        cfg.eval.output = str(Path(run_dir) / f"eval_{name}.json")
        out[name] = ftcore_eval.evaluate(cfg, state)
    return out


def trl_trainer(hf_dir: str, adapter: str, records: list[dict], out: Path):
    """TRL's DPOTrainer for the adapter: the PEFT model as the policy, the base as ref_model."""
    import torch
    from datasets import Dataset
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    def base():
        return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)

    args = DPOConfig(output_dir=str(out), per_device_eval_batch_size=1, use_cpu=True,
                     report_to=[], beta=0.1, max_length=None, bf16=False, padding_free=False,
                     disable_tqdm=True)  # fmt: skip
    data = Dataset.from_list(records)
    return DPOTrainer(model=PeftModel.from_pretrained(base(), adapter), ref_model=base(),
                      args=args, train_dataset=data, eval_dataset=data,
                      processing_class=AutoTokenizer.from_pretrained(hf_dir))  # fmt: skip


def trl_evaluate(trainer, types: list[str]) -> dict:
    """evaluate() with these losses: the attributes DPOTrainer.__init__ sets from loss_type and
    loss_weights (one trainer per record shape: its tokenized data and models are reused)."""
    trainer.loss_types, trainer.loss_weights = list(types), [1.0] * len(types)
    return {k.removeprefix("eval_"): v for k, v in trainer.evaluate().items()}


@pytest.fixture(scope="module")
def runs(pool1, tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_oracle")
    hf_dir = str(make_tiny_hf(root / "base"))
    train = _write(root / "train.jsonl", _records(12, False, 0))
    (adapter,) = set(pool1.run(train_case, hf_dir, str(root / "run"), train))
    shapes = {}
    for shape in ("standard", "conversational"):
        records = _records(4, shape == "conversational", 1)
        data = _write(root / f"{shape}.jsonl", records)
        ours = pool1.run(eval_case, hf_dir, str(root / f"eval_{shape}"), data, adapter, 4)[0]
        shapes[shape] = (records, ours)
    return hf_dir, adapter, shapes, root


@pytest.fixture(scope="module")
def trl(runs):
    hf_dir, adapter, shapes, root = runs
    return {s: trl_trainer(hf_dir, adapter, shapes[s][0], root / f"trl_{s}") for s in shapes}


@pytest.mark.parametrize("shape", ["standard", "conversational"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_ftcore_eval_gives_trls_numbers(runs, trl, shape, loss):
    records, ours = runs[2][shape]
    ours = ours[loss]
    want = trl_evaluate(trl[shape], LOSSES[loss])
    assert ours["pairs"] == len(records)
    assert ours["rewards/accuracies"] == want["rewards/accuracies"]
    for k in ("loss", *KEYS):
        assert math.isclose(ours[k], want[k], rel_tol=1e-5, abs_tol=1e-6), (k, ours[k], want[k])


def test_the_adapter_learned_and_loads_in_peft(runs):
    """The run trained something: the reference is not the policy (rewards differ from zero)."""
    _, adapter, shapes, _ = runs
    assert (Path(adapter) / "adapter_config.json").is_file()
    _, ours = shapes["standard"]
    assert abs(ours["sigmoid"]["rewards/margins"]) > 1e-3


def ref_adapter_case(hf_dir: str, run_dir: str, data: str, adapter: str) -> dict:
    """Worker: objective.ref_adapter_path: the reference is base + that adapter, and the policy
    starts from it (TRL's "ref" copy of a pretrained adapter): every reward is zero."""
    from ftcore import eval as ftcore_eval
    from ftcore.training import trainer

    cfg = _cfg(hf_dir, run_dir, data, f"objective.ref_adapter_path={adapter}",
               "train.global_batch_size=4", "train.micro_batch_size=1")  # fmt: skip
    cfg.eval.output = str(Path(run_dir) / "eval.json")
    state = trainer.setup(cfg, data=False, kind="eval")
    return ftcore_eval.evaluate(cfg, state)


def test_a_reference_adapter_is_where_the_policy_starts(runs, pool1):
    hf_dir, adapter, shapes, root = runs
    data = str(root / "standard.jsonl")
    got = pool1.run(ref_adapter_case, hf_dir, str(root / "ref_adapter"), data, adapter)[0]
    assert got["rewards/chosen"] == got["rewards/rejected"] == 0.0
    assert got["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert got["logps/chosen"] == pytest.approx(
        shapes["standard"][1]["sigmoid"]["logps/chosen"], rel=1e-6
    )
