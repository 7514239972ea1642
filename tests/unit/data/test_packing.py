"""Packing: first-fit-decreasing, most-documents-first and the fewer rows of the two, the
micro-batch tensors, the block-diagonal causal mask, and packed vs unpacked parity of loss and
gradients on Hugging Face's Llama (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ftcore.data.packing import (
    attention_mask_from_segments,
    cu_seqlens_from_segments,
    first_fit_decreasing,
    make_microbatch,
    most_documents_first,
    pack,
    real_tokens,
)
from ftcore.data.templates import Doc

PAD = 99


def naive_ffd(lengths, cap):
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, free = [], []
    for i in order:
        for b in range(len(bins)):
            if free[b] >= lengths[i]:
                bins[b].append(i)
                free[b] -= lengths[i]
                break
        else:
            bins.append([i])
            free.append(cap - lengths[i])
    return bins


@pytest.mark.parametrize("seed", range(5))
def test_ffd_matches_naive_first_fit_decreasing(seed):
    r = np.random.default_rng(seed)
    lengths = r.integers(1, 64, size=int(r.integers(1, 300))).tolist()
    bins = first_fit_decreasing(lengths, 64)
    assert bins == naive_ffd(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)


def test_ffd_edge_cases():
    assert first_fit_decreasing([], 8) == []
    assert first_fit_decreasing([8, 8], 8) == [[0], [1]]
    assert first_fit_decreasing([3, 5, 4, 4], 8) == [[1, 0], [2, 3]]
    with pytest.raises(ValueError):
        first_fit_decreasing([9], 8)


def naive_most_documents_first(lengths, cap):
    left = list(range(len(lengths)))  # items not in a bin yet, in input order
    bins = []
    while left:
        pool = sorted(lengths[i] for i in left)
        first = pool.pop()  # (a) the longest
        space = cap - first
        chosen = []
        while pool and sum(chosen) + pool[0] <= space:  # (b) as many as fit, shortest first
            chosen.append(pool.pop(0))
        for j in reversed(range(len(chosen))):  # (c) longest chosen first
            slack = space - sum(chosen)
            longer = [x for x in pool if chosen[j] < x <= chosen[j] + slack]
            if longer:
                pool.remove(max(longer))
                pool.append(chosen[j])
                chosen[j] = max(longer)
        b = []  # longest first; the earliest unused items of each length
        for x in sorted([first] + chosen, reverse=True):
            b.append(next(i for i in left if lengths[i] == x and i not in b))
        left = [i for i in left if i not in b]
        bins.append(b)
    return bins


def random_lengths(seed):
    """Lengths in [1, cap] of one of four shapes: uniform, narrow (like the bundled data), only
    1, cap and its halves and thirds, and mostly short with a long tail."""
    r = np.random.default_rng(seed)
    cap = int(r.choice([1, 2, 7, 64, 128, 200]))
    n = int(r.integers(0, 250))
    shape = seed % 4
    if shape == 0:
        lengths = r.integers(1, cap + 1, n)
    elif shape == 1:
        lengths = r.integers(cap // 6 + 1, cap // 4 + 2, n)
    elif shape == 2:
        lengths = r.choice([1, cap, cap // 2 + 1, cap // 3 + 1], n)
    else:
        lengths = 1 + r.geometric(min(1.0, 4 / cap), n)
    return np.minimum(lengths, cap).tolist(), cap


@pytest.mark.parametrize("seed", range(40))
def test_most_documents_first_matches_naive(seed):
    lengths, cap = random_lengths(seed)
    bins = most_documents_first(lengths, cap)
    assert bins == naive_most_documents_first(lengths, cap)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert most_documents_first(list(lengths), cap) == bins  # deterministic


@pytest.mark.parametrize("seed", range(40))
def test_pack_never_more_rows_than_ffd(seed):
    lengths, cap = random_lengths(seed)
    ffd, bins = first_fit_decreasing(lengths, cap), pack(lengths, cap)
    assert len(bins) <= len(ffd)
    if len(bins) == len(ffd):
        assert bins == ffd  # FFD's rows are kept where they are as good
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= cap for b in bins)
    assert pack(list(lengths), cap) == bins


def test_pack_fills_rows_of_bundled_like_data():
    # The bundled data: 4000 documents of 20..30 tokens, mean 25.4, in rows of 128. FFD puts four
    # ~30-token documents in a row and nothing else fits; five documents fit when the mean <= 25.6.
    lengths = np.random.default_rng(0).integers(21, 31, 4000).tolist()
    ffd, bins = first_fit_decreasing(lengths, 128), pack(lengths, 128)
    assert len(bins) <= 0.95 * len(ffd)
    assert len(bins) == 800 and all(len(b) == 5 for b in bins)


def test_most_documents_first_edge_cases():
    assert most_documents_first([], 8) == [] and pack([], 8) == []
    assert most_documents_first([8, 8], 8) == [[0], [1]]
    assert most_documents_first([1] * 5, 1) == [[0], [1], [2], [3], [4]]
    # FFD: [5, 5], [4, 4, 3], [3]; here the first row keeps 3 + 3 of room for the 4 and the 3
    assert most_documents_first([5, 5, 4, 4, 3, 3], 12) == [[0, 2, 4], [1, 3, 5]]
    assert pack([5, 5, 4, 4, 3, 3], 12) == [[0, 2, 4], [1, 3, 5]]
    assert pack([3, 5, 4, 4], 8) == first_fit_decreasing([3, 5, 4, 4], 8)  # a tie: FFD's rows
    with pytest.raises(ValueError):
        most_documents_first([9], 8)
    with pytest.raises(ValueError):
        most_documents_first([0, 3], 8)
    with pytest.raises(ValueError):
        pack([3, 9], 8)


def doc(ids, targets):
    return Doc(np.asarray(ids, np.int32), np.asarray(targets, bool))


def test_microbatch_tensors_by_hand():
    a = doc([10, 11, 12, 13], [0, 0, 1, 1])
    b = doc([20, 21, 22], [0, 1, 1])
    mb = make_microbatch([[a, b], [b], []], seq_len=8, pad_id=PAD)
    assert mb.tokens.tolist() == [
        [10, 11, 12, 13, 20, 21, 22, PAD],
        [20, 21, 22, PAD, PAD, PAD, PAD, PAD],
        [PAD] * 8,
    ]
    # labels[t] = next token of the same document where it is a target; the last token of a
    # document predicts nothing (never the first token of the next document).
    assert mb.labels.tolist() == [
        [0, 12, 13, 0, 21, 22, 0, 0],
        [21, 22, 0, 0, 0, 0, 0, 0],
        [0] * 8,
    ]
    assert mb.loss_mask.tolist() == [
        [0, 1, 1, 0, 1, 1, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [0] * 8,
    ]
    assert mb.position_ids.tolist()[0] == [0, 1, 2, 3, 0, 1, 2, 0]
    assert mb.segment_ids.tolist()[0] == [1, 1, 1, 1, 2, 2, 2, 0]
    assert mb.num_tokens == 10 and mb.num_target_tokens == 6
    assert mb.tokens.dtype == torch.int64 and mb.labels.dtype == torch.int64
    assert mb.loss_mask.dtype == torch.float32 and mb.segment_ids.dtype == torch.int32
    with pytest.raises(ValueError):
        make_microbatch([[a, a, b]], seq_len=8, pad_id=PAD)


def test_real_tokens_leave_out_row_and_document_padding():
    """A MoE router's valid tokens (docs/moe.md): not the row's end, and under CP (doc_multiple)
    not the pads each document gets with its own segment id either."""
    a = doc([10, 11, 12], [0, 1, 1])
    b = doc([20, 21, 22, 23, 24], [0, 1, 1, 1, 1])
    plain = make_microbatch([[a, b]], seq_len=12, pad_id=PAD)
    assert real_tokens(plain).int().tolist() == [[1] * 8 + [0] * 4]
    cp = make_microbatch([[a, b], [a]], seq_len=12, pad_id=PAD, doc_multiple=4)
    assert cp.segment_ids.tolist()[0] == [1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
    assert real_tokens(cp).int().tolist() == [
        [1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert int(real_tokens(cp).sum()) == cp.num_tokens


def test_attention_mask_block_diagonal_causal():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0]], dtype=torch.int32)
    m = attention_mask_from_segments(seg)
    assert m.shape == (1, 1, 6, 6) and m.dtype == torch.bool
    allowed = (~m[0, 0]).int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],  # padding sees only itself: no row is all-masked
    ]


def test_cu_seqlens():
    seg = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1]], dtype=torch.int32)
    cu, max_len = cu_seqlens_from_segments(seg)
    assert cu.tolist() == [0, 2, 5, 6, 12] and max_len == 6 and cu.dtype == torch.int32


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(cfg).double()


def _loss_and_grads(model, mb):
    """Per-token loss over the micro-batch's targets (megatron's), and the gradients."""
    model.zero_grad()
    masked = attention_mask_from_segments(mb.segment_ids)
    additive = torch.zeros(masked.shape, dtype=torch.float64).masked_fill(masked, float("-inf"))
    logits = model(mb.tokens, attention_mask=additive, position_ids=mb.position_ids).logits
    ce = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), mb.labels.flatten(), reduction="none"
    )
    loss = (ce * mb.loss_mask.flatten().double()).sum() / mb.loss_mask.sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_equals_unpacked_on_hf_llama():
    r = np.random.default_rng(0)
    docs = [doc(r.integers(0, 128, n), r.random(n) < 0.6) for n in (9, 5, 12, 7, 3)]
    model = _llama()
    bins = first_fit_decreasing([len(d) for d in docs], 16)
    assert len(bins) < len(docs)
    packed = make_microbatch([[docs[i] for i in b] for b in bins], 16, PAD)
    unpacked = make_microbatch([[d] for d in docs], 16, PAD)
    assert packed.num_target_tokens == unpacked.num_target_tokens
    lp, gp = _loss_and_grads(model, packed)
    lu, gu = _loss_and_grads(model, unpacked)
    torch.testing.assert_close(lp, lu, rtol=1e-10, atol=0)
    for n in gp:
        torch.testing.assert_close(gp[n], gu[n], rtol=1e-9, atol=1e-12)
