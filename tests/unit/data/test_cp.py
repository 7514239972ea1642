"""data/cp.py's per-document split (packed rows under CP) against Transformer Engine's
thd_get_partitioned_indices: a hand-worked row, and a line-by-line Python transcription of TE's
kernel (transformer_engine/common/fused_attn/thd_utils.cu, thd_partition_indices_kernel) on
random rows. The whole-row case against megatron's get_batch_on_this_cp_rank runs under gloo in
tests/multiproc/test_context_parallel.py."""

from __future__ import annotations

import numpy as np
import torch

from ftcore.data.cp import document_positions, gathered_row_positions, row_positions, shard
from ftcore.data.packing import make_microbatch
from ftcore.data.templates import Doc


def te_partitioned_indices(cu_seqlens: list[int], total: int, world: int, rank: int) -> list[int]:
    """TE's kernel, one thread per output token: binary search of the token's sequence in the
    per-rank boundaries, then its offset into the first or the mirrored chunk."""
    cu_s = [c // world for c in cu_seqlens]
    out = []
    for token_id in range(total // world):
        left, right = 1, len(cu_s) - 1  # binary_search(token_id, cu_s, batch + 1)
        while left < right:
            mid = (left + right) // 2
            if cu_s[mid] <= token_id:
                left = mid + 1
            else:
                right = mid
        seq_id = left - 1
        seq_len = cu_s[seq_id + 1] - cu_s[seq_id]
        index = token_id - cu_s[seq_id]
        offset = rank if index < seq_len // 2 else (world - 1) * 2 - rank
        out.append(index + cu_s[seq_id] * world + seq_len // 2 * offset)
    return out


def test_hand_worked_row():
    # documents padded to 8, 4, 4 tokens at cp=2: chunks of 2, 1 and 1 token
    cu = torch.tensor([0, 8, 12, 16], dtype=torch.int32)
    assert document_positions(cu, 2, 0).tolist() == [0, 1, 6, 7, 8, 11, 12, 15]
    assert document_positions(cu, 2, 1).tolist() == [2, 3, 4, 5, 9, 10, 13, 14]
    for rank in range(2):
        assert document_positions(cu, 2, rank).tolist() == te_partitioned_indices(
            cu.tolist(), 16, 2, rank
        )


def test_random_rows_match_te_kernel():
    g = np.random.default_rng(0)
    for cp in (2, 3, 4):
        for _ in range(20):
            lengths = 2 * cp * g.integers(1, 6, g.integers(1, 6))
            cu = [0, *np.cumsum(lengths).tolist()]
            ranks = [document_positions(torch.tensor(cu), cp, r) for r in range(cp)]
            for r in range(cp):
                assert ranks[r].tolist() == te_partitioned_indices(cu, cu[-1], cp, r)
            assert sorted(torch.cat(ranks).tolist()) == list(range(cu[-1]))  # a partition


def test_padded_documents_and_their_split():
    """Documents of 5 and 2 tokens padded to 8 and 4 at cp=2, then the row's padding (4); a
    second row of one 16-token document. Pads: no loss, positions continue, the document's id."""
    d5 = Doc(np.arange(10, 15, dtype=np.int32), np.ones(5, bool))
    d2 = Doc(np.arange(20, 22, dtype=np.int32), np.ones(2, bool))
    d16 = Doc(np.arange(30, 46, dtype=np.int32), np.ones(16, bool))
    mb = make_microbatch([[d5, d2], [d16]], 16, 0, doc_multiple=4)
    assert mb.segment_ids[0].tolist() == [1] * 8 + [2] * 4 + [0] * 4
    assert mb.position_ids[0].tolist() == [*range(8), *range(4), *[0] * 4]
    assert mb.loss_mask[0].tolist() == [1] * 4 + [0] * 4 + [1] + [0] * 7
    assert mb.tokens[0, :8].tolist() == [10, 11, 12, 13, 14, 0, 0, 0]
    assert mb.cu_seqlens_padded.tolist() == [0, 8, 12, 16, 32]
    assert mb.cu_seqlens.tolist() == [0, 5, 7, 11, 27]  # real lengths; the row's padding as is
    assert mb.max_seqlen == 16 and mb.num_tokens == 23
    rows = row_positions(mb, 2, 1)
    assert rows[0].tolist() == [2, 3, 4, 5, 9, 10, 13, 14]
    assert rows[1].tolist() == list(range(4, 12))  # one document: the whole-row chunks
    assert gathered_row_positions(mb, 2)[0].tolist() == [0, 1, 6, 7, 8, 11, 12, 15, *rows[0]]
    assert shard(mb, 2, 1).tokens[0].tolist() == [12, 13, 14, 0, 21, 0, 0, 0]
    plain = make_microbatch([[d5, d2]], 16, 0)
    assert plain.cu_seqlens_padded is None and plain.segment_ids[0, 6] == 2  # unpadded
