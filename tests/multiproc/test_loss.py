"""The per-token loss equals a direct computation on the same batch; vocab padding never leaks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.layouts import build


def direct_vs_ftcore(overrides, run_dir):
    from ftcore.data.pipeline import attention_mask_from_segments
    from ftcore.models.sharding import unwrap
    from ftcore.training import trainer

    state = build(overrides, run_dir)
    microbatches = state.loader.next_microbatches()
    loss_sum, n = trainer.run_batches(state, microbatches, forward_only=True)
    model = unwrap(state.model[0])
    vocab = model.vocab_size_unpadded
    total, count = 0.0, 0.0
    with torch.no_grad():
        for mb in microbatches:
            logits = model(mb.tokens, mb.position_ids, attention_mask_from_segments(mb.segment_ids))
            assert logits.shape[-1] > vocab  # 2100 rows padded to 2176
            ce = F.cross_entropy(
                logits[..., :vocab].reshape(-1, vocab).double(),
                mb.labels.reshape(-1),
                reduction="none",
            )
            total += float((ce * mb.loss_mask.reshape(-1)).sum())
            count += float(mb.loss_mask.sum())
    return {"ftcore": loss_sum / n, "direct": total / count, "n": n, "count": count}


@pytest.mark.dist
def test_per_token_loss_matches_direct_computation(pool1, tmp_path):
    r = pool1.run(direct_vs_ftcore, ["model.vocab_size=2100"], str(tmp_path))[0]
    assert r["n"] == r["count"]
    assert abs(r["ftcore"] - r["direct"]) <= 1e-6 * r["direct"], r
