"""The Hugging Face side of bench/cpu_vs_hf: the recipe users would otherwise run.

`transformers.Trainer` + PEFT LoRA (r, alpha and target modules from the ftcore config: all seven
projections), `DataCollatorForSeq2Seq` padding each batch to its longest sample, prompt tokens
labelled -100, AdamW with ftcore's settings, one epoch, one process. The documents are ftcore's own
rendering of the same records (same token ids, same truncation), so both sides see exactly the same
tokens; tokenization is outside the timed part on both sides. Run as
`python -m ftcore.bench.hf_recipe` with FTCORE_BENCH_SPEC naming {"out", "model_dir", "overrides",
"batch_size", "threads"}; it writes the result JSON.
"""

from __future__ import annotations

import json
import math
import os
import resource
import time
from pathlib import Path

from ftcore.bench.turns import Turn

SPEC_ENV = "FTCORE_BENCH_SPEC"
DEFAULT_SHAPE = {  # the tiny model's shape: a few million parameters on the bundled tokenizer
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}


def make_hf_model(out_dir: str | Path, shape: dict | None = None, seed: int = 1234) -> Path:
    """A small random HF Llama (safetensors + config + the bundled tokenizer) in out_dir."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ftcore.config.schema import assets_dir

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    conf = LlamaConfig(
        vocab_size=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **{**DEFAULT_SHAPE, **(shape or {})},
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(conf).save_pretrained(out, safe_serialization=True)
    for f in (assets_dir() / "tokenizer").iterdir():
        shutil.copy(f, out / f.name)
    return out


def _rows(docs, seq_len: int) -> list[dict]:
    """HF training rows: input ids, attention mask, labels (-100 where not a target)."""
    rows = []
    for d in docs:
        ids = [int(x) for x in d.ids[:seq_len]]
        tgt = d.targets[:seq_len]
        labels = [i if t else -100 for i, t in zip(ids, tgt)]
        rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels})
    return rows


def load_rows(cfg, tokenizer) -> tuple[list[dict], list[dict]]:
    """(train rows, validation rows) from ftcore's data pipeline: the documents ftcore trains on."""
    from ftcore.data.pipeline import build_train_loader, bundled_data
    from ftcore.data.tokenized import tokenize_source

    loader = build_train_loader(cfg, tokenizer, 0, 1)
    val_path = cfg.data.val_path or bundled_data("val")
    val = tokenize_source(val_path, tokenizer, cfg.data, None, "data.val_path")
    val_docs = [val.doc(i) for i in range(len(val))][: cfg.eval.get("max_samples") or None]
    return _rows(loader.docs.docs, cfg.data.seq_len), _rows(val_docs, cfg.data.seq_len)


def eval_loss(model, rows: list[dict], collator, batch_size: int) -> tuple[float, int]:
    """Sum of next-token cross entropy over every target token / their number (ftcore's loss)."""
    import torch
    import torch.nn.functional as F

    model.eval()
    total, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            b = collator(rows[i : i + batch_size])
            logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
            labels = b["labels"][:, 1:]
            ce = F.cross_entropy(
                logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                labels.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            total += float(ce)
            n += int((labels != -100).sum())
    return total / max(n, 1), n


def _scheduler(cfg) -> tuple[str, dict]:
    s = cfg.sched
    if s.name == "constant":
        return "constant_with_warmup", {}
    if s.name == "linear":
        return "linear", {}
    return "cosine_with_min_lr", {"min_lr": float(s.min_lr)}


def train_hf(spec: dict) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainingArguments,
    )
    from transformers.utils import logging as hf_logging

    from ftcore.config.schema import compose

    hf_logging.set_verbosity_error()
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    cfg = compose(list(spec["overrides"]))
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    train_rows, val_rows = load_rows(cfg, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype=torch.float32)
    p = cfg.peft
    lora = LoraConfig(
        r=int(p.r),
        lora_alpha=float(p.lora_alpha),
        lora_dropout=float(p.lora_dropout),
        target_modules=[str(t) for t in p.target_modules],
        use_rslora=bool(p.use_rslora),
        task_type="CAUSAL_LM",
    )
    torch.manual_seed(int(cfg.run.seed))  # PEFT draws lora_A from the global RNG: same every run
    model = get_peft_model(model, lora)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    o = cfg.optim
    sched, sched_kwargs = _scheduler(cfg)
    bs = int(spec["batch_size"])
    args = TrainingArguments(
        output_dir=spec["work_dir"],
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=float(o.lr),
        weight_decay=float(o.weight_decay),
        adam_beta1=float(o.betas[0]),
        adam_beta2=float(o.betas[1]),
        adam_epsilon=float(o.eps),
        optim="adamw_torch",
        max_grad_norm=float(cfg.train.grad_clip),
        lr_scheduler_type=sched,
        lr_scheduler_kwargs=sched_kwargs,
        warmup_steps=int(cfg.sched.warmup_steps),
        logging_steps=max(1, math.ceil(len(train_rows) / bs)),  # once: logging is not the subject
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=int(cfg.run.seed),
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train_rows, data_collator=collator)
    turn = Turn.from_env()
    if turn is not None:  # hand over to the round's other runs every few steps (bench.turns)
        trainer.add_callback(_turn_callback(turn))
    t0, c0 = time.perf_counter(), time.process_time()
    out = trainer.train()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    waited = turn.waited_s if turn is not None else 0.0
    wall -= waited
    loss, n = eval_loss(model, val_rows, collator, bs)
    tokens = sum(len(r["input_ids"]) for r in train_rows)
    targets = sum(sum(1 for x in r["labels"][1:] if x != -100) for r in train_rows)
    return {
        "side": "hf",
        "steps": int(out.global_step),
        "tokens": tokens,
        "target_tokens": targets,
        "wall_s": wall,
        "cpu_s": cpu,
        "train_loss": float(out.training_loss),
        "eval_loss": loss,
        "eval_tokens": n,
        "peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "threads": torch.get_num_threads(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "batch_size": bs,
        "waited_s": waited,
    }


def _turn_callback(turn: Turn):
    from transformers import TrainerCallback

    class TakeTurns(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            turn.start(state.max_steps)

        def on_step_end(self, args, state, control, **kwargs):
            turn.after_step()

    return TakeTurns()


def main() -> int:
    from ftcore.cli import setup_logging

    setup_logging()
    spec = json.loads(Path(os.environ[SPEC_ENV]).read_text())
    result = train_hf(spec)
    tmp = Path(spec["out"]).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, spec["out"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
