"""The Hugging Face side of bench/cpu_vs_hf: the recipe an HF expert would run, at its best.

`transformers.Trainer` + PEFT LoRA (r, alpha and target modules from the ftcore config: all seven
projections), SDPA attention, fused AdamW (`optim="adamw_torch_fused"`, the kernel ftcore's
optimizer uses) with ftcore's settings, prompt tokens labelled -100, and one of two collators:
`padded` (DataCollatorForSeq2Seq, each batch padded to its longest document) or `flattened`
(DataCollatorWithFlattening: the batch in one row, documents kept apart by position_ids; the
padding-free path). Each optimizer step trains on exactly the documents the paired ftcore run
puts in its step (ftcore.bench.steps: ftcore's own loader says which), and the run is timed from
the end of step bench.warmup_steps to the end of the last step (a TrainerCallback at on_step_end).
The documents are ftcore's own rendering of the records (same token ids, same truncation);
tokenization is outside the timed part on both sides. Run as `python -m ftcore.bench.hf_recipe`
with FTCORE_BENCH_SPEC naming {"out", "model_dir", "overrides" (the paired ftcore run's),
"collator", "optim", "warmup", "threads", "work_dir"}; it writes the result JSON.
"""

from __future__ import annotations

import resource
from pathlib import Path

from ftcore.bench.runner import read_spec, write_result
from ftcore.bench.steps import StepClock, check_warmup, digest, epoch_steps, step_groups
from ftcore.bench.turns import Turn
from ftcore.errors import FtcoreError

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


def load_rows(cfg, tokenizer, warmup: int = 0) -> tuple[list[dict], list[list[int]], list[dict]]:
    """(every training document as a row, the document ids of each optimizer step of ftcore's
    epoch, validation rows), all from ftcore's data pipeline for the paired ftcore run's config:
    a fresh loader hands out exactly the global batches the ftcore run's loader will."""
    from ftcore.data.pipeline import build_train_loader, bundled_data
    from ftcore.data.tokenized import tokenize_source

    loader = build_train_loader(cfg, tokenizer, 0, 1)
    steps = epoch_steps(loader.report["rows"], int(cfg.train.global_batch_size))
    check_warmup(steps, warmup)
    groups = step_groups(loader, steps)
    val_path = cfg.data.val_path or bundled_data("val")
    val = tokenize_source(val_path, tokenizer, cfg.data, None, "data.val_path")
    val_docs = [val.doc(i) for i in range(len(val))][: cfg.eval.get("max_samples") or None]
    return _rows(loader.docs.docs, cfg.data.seq_len), groups, _rows(val_docs, cfg.data.seq_len)


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
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ftcore.config.schema import compose

    hf_logging.set_verbosity_error()
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    cfg = compose(list(spec["overrides"]))
    warmup = int(spec.get("warmup", 0))
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"], trust_remote_code=False)
    train_rows, groups, val_rows = load_rows(cfg, tokenizer, warmup)
    p = cfg.peft
    model = lora_model(spec["model_dir"], r=p.r, alpha=p.lora_alpha, targets=p.target_modules,
                       dropout=p.lora_dropout, rslora=p.use_rslora, seed=int(cfg.run.seed))  # fmt: skip
    padded = make_collator("padded", tokenizer)
    collator = Counted(make_collator(spec.get("collator", "padded"), tokenizer))
    turn = Turn.from_env()
    clock = StepClock(turn)
    trainer = _trainer(model, cfg, spec, train_rows, groups, collator)
    trainer.add_callback(_step_callback(clock, turn))
    out = trainer.train()
    span = clock.span(warmup)
    loss, n = eval_loss(model, val_rows, padded, int(spec.get("eval_batch_size", 16)))
    steps = int(out.global_step)
    counts = collator.counts[:steps]
    return {
        "side": "hf",
        "collator": spec.get("collator", "padded"),
        "optim": trainer.args.optim,
        "steps": steps,
        "warmup_steps": warmup,
        **span,
        "tokens": sum(c[0] for c in counts[warmup:]),
        "target_tokens": sum(c[1] for c in counts[warmup:]),
        "epoch_tokens": sum(c[0] for c in counts),
        "epoch_target_tokens": sum(c[1] for c in counts),
        "groups_digest": digest(groups),
        "train_loss": float(out.training_loss),  # mean of the steps' losses
        "eval_loss": loss,
        "eval_tokens": n,
        "peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "threads": torch.get_num_threads(),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
    }


def lora_model(model_dir, *, r, alpha, targets, dropout=0.0, rslora=False, seed=None):
    """The HF Llama in model_dir (fp32, SDPA attention) with PEFT LoRA on `targets`. `seed`
    reseeds torch's RNG first: PEFT draws lora_A from it, so every run starts the same."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, trust_remote_code=False,
                                                 attn_implementation="sdpa")  # fmt: skip
    lora = LoraConfig(r=int(r), lora_alpha=float(alpha), lora_dropout=float(dropout),
                      target_modules=[str(t) for t in targets], use_rslora=bool(rslora),
                      task_type="CAUSAL_LM")  # fmt: skip
    if seed is not None:
        torch.manual_seed(seed)
    return get_peft_model(model, lora)


def make_collator(kind: str, tokenizer):
    """padded: each batch padded to its longest document (DataCollatorForSeq2Seq); flattened:
    the batch's documents in one row, kept apart by position_ids (DataCollatorWithFlattening:
    SDPA builds the block-diagonal causal mask from them)."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening

    if kind == "padded":
        return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    if kind == "flattened":
        return DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    raise FtcoreError(f"unknown HF collator {kind!r}", field="bench.runs[].hf",
                      fix="padded or flattened")  # fmt: skip


class Counted:
    """A collator that counts what each batch it makes holds: (non-padding tokens, target tokens
    the loss counts, i.e. labels after the first position that are not -100)."""

    def __init__(self, collator):
        self.collator, self.counts = collator, []

    def __call__(self, features):
        b = self.collator(features)
        mask = b.get("attention_mask")
        tokens = int(mask.sum()) if mask is not None else int(b["input_ids"].numel())
        self.counts.append((tokens, int((b["labels"][:, 1:] != -100).sum())))
        return b


def _trainer(model, cfg, spec: dict, rows: list[dict], groups: list[list[int]], collator):
    """transformers.Trainer with ftcore's optimizer settings, whose training batches are the
    documents of ftcore's optimizer steps, one batch per step, in ftcore's order."""
    from torch.utils.data import DataLoader
    from transformers import Trainer, TrainingArguments

    class StepGroupTrainer(Trainer):
        def get_train_dataloader(self):
            loader = DataLoader(self.train_dataset, batch_sampler=groups, collate_fn=collator,
                                num_workers=0)  # fmt: skip
            return self.accelerator.prepare(loader)

    o = cfg.optim
    sched, sched_kwargs = _scheduler(cfg)
    args = TrainingArguments(
        output_dir=spec["work_dir"],
        per_device_train_batch_size=int(cfg.train.global_batch_size),  # unused: the groups are
        gradient_accumulation_steps=1,
        num_train_epochs=1,
        learning_rate=float(o.lr),
        weight_decay=float(o.weight_decay),
        adam_beta1=float(o.betas[0]),
        adam_beta2=float(o.betas[1]),
        adam_epsilon=float(o.eps),
        optim=spec.get("optim", "adamw_torch_fused"),
        max_grad_norm=float(cfg.train.grad_clip),
        lr_scheduler_type=sched,
        lr_scheduler_kwargs=sched_kwargs,
        warmup_steps=int(cfg.sched.warmup_steps),
        logging_steps=len(groups),  # once: logging is not the subject
        save_strategy="no",
        eval_strategy="no",
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        seed=int(cfg.run.seed),
        disable_tqdm=True,
    )
    return StepGroupTrainer(model=model, args=args, train_dataset=rows, data_collator=collator)


def _step_callback(clock: StepClock, turn: Turn | None):
    """Marks the start and the end of every optimizer step (bench.steps), then hands the turn
    over every few steps (bench.turns)."""
    from transformers import TrainerCallback

    class StepEnds(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if turn is not None:
                turn.start(state.max_steps)
            clock.mark()

        def on_step_end(self, args, state, control, **kwargs):
            clock.mark()
            if turn is not None:
                turn.after_step()

    return StepEnds()


def main() -> int:
    from ftcore.cli import setup_logging

    setup_logging()
    spec = read_spec()
    write_result(spec, train_hf(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
