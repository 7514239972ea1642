"""The HF side of cpu_vs_hf: its padding-free collator is the same math as padding (an oracle
check of the recipe against transformers' own Llama), and its counts are what the loss counts."""

from __future__ import annotations

import pytest
import torch

from ftcore.bench.hf_recipe import Counted, make_collator
from ftcore.errors import FtcoreError


def _docs(seed: int = 0) -> list[dict]:
    """Four documents of different lengths; the first few tokens of each are prompt (-100)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, prompt in ((9, 3), (23, 5), (4, 2), (15, 15 - 6)):
        ids = torch.randint(0, 96, (n,), generator=g).tolist()
        out.append({"input_ids": ids, "attention_mask": [1] * n,
                    "labels": [-100] * prompt + ids[prompt:]})  # fmt: skip
    return out


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama with SDPA attention, as transformers.Trainer leaves it for training.
    The Trainer matters: it sets config.use_cache = False (TrainingArguments.use_cache); with a
    cache (the config's default) transformers 5.24 builds no packed-sequence mask from
    position_ids, and a flattened row becomes one long causal document."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    torch.manual_seed(0)
    conf = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=0, bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = LlamaForCausalLM(conf).to(torch.float32)
    model.config._attn_implementation = "sdpa"
    args = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("trainer")), use_cpu=True,
                             report_to=[], optim="adamw_torch_fused")  # fmt: skip
    trainer = Trainer(model=model, args=args)
    trainer.create_optimizer()  # the recipe's optimizer exists on this CPU build
    assert type(trainer.optimizer).__name__ == "AdamW" and trainer.optimizer.defaults["fused"]
    assert model.config.use_cache is False
    return model


class _Tok:
    """What DataCollatorForSeq2Seq needs of a tokenizer: pad() through transformers' own."""

    def __init__(self):
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        self.t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<pad>": 0}, "<pad>")),
                                         pad_token="<pad>")  # fmt: skip


def test_flattened_batch_has_the_padded_batch_loss(llama):
    """transformers' DataCollatorWithFlattening + SDPA (position_ids restart per document) gives
    the loss and the gradients of DataCollatorForSeq2Seq's padded batch of the same documents."""
    model = llama
    tok = _Tok().t
    docs = _docs()
    results = []
    for kind in ("padded", "flattened"):
        counted = Counted(make_collator(kind, tok))
        batch = counted(docs)
        if kind == "flattened":
            assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grad = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
        results.append((float(loss), grad, counted.counts[0]))
    (lp, gp, cp), (lf, gf, cf) = results
    assert lf == pytest.approx(lp, rel=1e-5)
    torch.testing.assert_close(gf, gp, rtol=1e-4, atol=1e-6)
    # same non-padding tokens and target tokens counted on both collators
    n = sum(len(d["input_ids"]) for d in docs)
    targets = sum(sum(x != -100 for x in d["labels"][1:]) for d in docs)
    assert cp == cf == (n, targets)


def test_flattening_is_not_one_long_document(llama):
    """The check above can fail: the same row as one causal sequence (no position_ids, or a
    cache, which turns off the packed-sequence mask) gives another loss."""
    model = llama
    batch = make_collator("flattened", _Tok().t)(_docs())
    with torch.no_grad():
        packed = float(model(**batch).loss)
        cached = float(model(**batch, use_cache=True).loss)
        batch.pop("position_ids")
        leaky = float(model(**batch).loss)
    assert abs(packed - leaky) > 1e-4 and abs(packed - cached) > 1e-4


def test_unknown_collator_is_a_user_error():
    with pytest.raises(FtcoreError, match="padded or flattened"):
        make_collator("bucketed", None)
