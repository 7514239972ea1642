"""Worker-side cases for context parallelism: packed synthetic batches, one run per layout that
trains unpacked and packed rows and evaluates, and the CP attention against the whole sequence."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from ftcore.data.cp import shard
from ftcore.data.packing import (
    attention_mask_from_segments,
    first_fit_decreasing,
    make_microbatch,
    padded_length,
)
from ftcore.data.pipeline import doc_multiple
from ftcore.data.templates import Doc
from ftcore.models.local.attention import SdpaAttention
from ftcore.models.sharding import unwrap
from ftcore.training import trainer
from ftcore.training.evaluation import evaluate
from tests.support.layouts import SyntheticLoader, build, full_weights, record_microbatches


class PackedLoader(SyntheticLoader):
    """Global batch k: documents of 2 to seq/2 tokens (random targets), first-fit-decreasing into
    rows of data.seq_len by their lengths rounded to `pack_multiple` at every cp (as ftcore's
    loader, data.pack_multiple), the first global_batch_size rows; each document padded to 2*cp
    under CP only (data/pipeline.py doc_multiple), so cp=1 pads nothing."""

    pack_multiple = 4

    def next_microbatches(self):
        t, seq = self.cfg.train, self.cfg.data.seq_len
        r = np.random.default_rng(self.seed * 100_003 + self.step)
        self.step += 1
        docs = [
            Doc(r.integers(0, self.vocab, n).astype(np.int32), r.random(n) < 0.7)
            for n in r.integers(2, seq // 2 + 1, 4 * t.global_batch_size)
        ]
        bins = first_fit_decreasing([padded_length(len(d), self.pack_multiple) for d in docs], seq)
        bins = bins[: t.global_batch_size]
        per = t.global_batch_size // self.dp
        mine = bins[self.dp_rank * per : (self.dp_rank + 1) * per]
        mbs = t.micro_batch_size
        return [
            make_microbatch(
                [[docs[d] for d in row] for row in mine[i : i + mbs]],
                seq,
                0,
                doc_multiple(self.cfg),
            )  # fmt: skip
            for i in range(0, per, mbs)
        ]


def train_unpacked_and_packed(overrides: list[str], run_dir: str, steps: int) -> dict:
    """Packed rows as PackedLoader makes them. Per mode: losses, grad norms, full weights, the eval loss of one more batch, the sequence
    lengths the attention saw (s / cp when the batch is really sharded), and the rows the output
    layer computed per training micro-batch against this rank's targets (models/target_logits.py)."""
    out = {}
    for mode in ("unpacked", "packed"):
        state = build(overrides, f"{run_dir}/{mode}")
        if mode == "packed":
            state.loader = PackedLoader(state.cfg, ps.get_data_parallel_rank(), state.dp,
                                        state.cfg.model.vocab_size)  # fmt: skip
        seen: set[int] = set()
        for chunk in state.model:
            for m in chunk.modules():
                if isinstance(m, SdpaAttention):
                    m.register_forward_hook(lambda mod, a, o, seen=seen: seen.add(a[0].shape[0]))
        rows, mbs = output_rows(state), record_microbatches(state)
        losses, norms, tokens = [], [], []
        for _ in range(steps):
            step = trainer.train_step(state)
            losses.append(step["loss"])
            norms.append(step["grad_norm"])
            tokens.append(step["tokens"])
        cp, rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        targets = [max(1, int(shard(mb, cp, rank).loss_mask.sum())) for mb in mbs] if rows else []
        held_out = evaluate(state, [state.loader.next_microbatches()])
        out[mode] = {"loss": losses, "grad_norm": norms, "tokens": tokens, "weights": full_weights(state),
                     "eval": (held_out.loss, held_out.tokens), "seen": sorted(seen),
                     "output_rows": rows[: len(targets)], "targets": targets}  # fmt: skip
    return out


def output_rows(state) -> list[int]:
    """A list that fills with the rows the output layer computes, per forward (last stage only)."""
    chunk, seen = unwrap(state.model[-1]), []
    if chunk.post_process:
        chunk.output_layer.register_forward_hook(
            lambda m, a, o: seen.append(a[0].shape[0] * a[0].shape[1])
        )
    return seen


def attention_against_whole(seed: int = 0) -> dict:
    """Two ranks, one CP group (the world): the CP attention's output and Q/K/V gradients at this
    rank's positions against SDPA over the whole packed sequence (float64, GQA); and this rank's
    micro-batch and RoPE angles against megatron's slicing functions."""
    from ftcore.data.cp import (
        document_positions,
        gathered_positions,
        gathered_row_positions,
        local_positions,
        row_positions,
    )
    from ftcore.models.local import cp_attention

    cp, rank = dist.get_world_size(), dist.get_rank()
    s, b, heads, groups, d = 32, 2, 4, 2, 8
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(s, b, groups, d, generator=g, dtype=torch.float64) for _ in range(2))
    grad_out = torch.randn(s, b, heads * d, generator=g, dtype=torch.float64)
    seg = torch.tensor([[1] * 5 + [2] * 13 + [3] * 10 + [0] * 4, [1] * 30 + [2] * 2])
    mask = attention_mask_from_segments(seg)
    scale = d**-0.5

    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    qw, kw, vw = (t.permute(1, 2, 0, 3) for t in whole)
    ref = F.scaled_dot_product_attention(qw, kw, vw, attn_mask=~mask, scale=scale, enable_gqa=True)
    ref = ref.permute(2, 0, 1, 3).reshape(s, b, heads * d)
    ref.backward(grad_out)

    idx = local_positions(s, cp, rank)
    mine = [t.index_select(0, idx).clone().requires_grad_() for t in (q, k, v)]
    rows, cols = idx.expand(b, -1), gathered_positions(s, cp).expand(b, -1)
    got = cp_attention.attention(*mine, cp_attention.local_mask(mask, rows, cols), scale,
                                 dist.group.WORLD)  # fmt: skip
    got.backward(grad_out.index_select(0, idx))

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    # packed rows split per document (TE's THD layout): documents of 5, 10, 7 and 27, 3 tokens
    # padded to multiples of 2*cp, each row its own positions
    docs = [[5, 10, 7], [27, 3]]
    mb = make_microbatch(
        [[Doc(np.arange(n, dtype=np.int32), np.ones(n, bool)) for n in r] for r in docs],
        s,
        0,
        2 * cp,
    )
    pmask = attention_mask_from_segments(mb.segment_ids)
    whole_p = [t.clone().requires_grad_() for t in (q, k, v)]
    qw, kw, vw = (t.permute(1, 2, 0, 3) for t in whole_p)
    ref_p = F.scaled_dot_product_attention(
        qw, kw, vw, attn_mask=~pmask, scale=scale, enable_gqa=True
    )
    ref_p = ref_p.permute(2, 0, 1, 3).reshape(s, b, heads * d)
    ref_p.backward(grad_out)
    prow = row_positions(mb, cp, rank)  # [b, s / cp]

    def at_rows(t):  # [s, b, ...] -> [s / cp, b, ...], row i at its positions prow[i]
        return torch.stack([t[prow[i], i] for i in range(b)], dim=1)

    mine_p = [at_rows(t).clone().requires_grad_() for t in (q, k, v)]
    pmask_local = cp_attention.local_mask(pmask, prow, gathered_row_positions(mb, cp))
    got_p = cp_attention.attention(*mine_p, pmask_local, scale, dist.group.WORLD)
    got_p.backward(at_rows(grad_out))
    packed = {
        f"packed_{n}": rel(m.grad, at_rows(w.grad)) for n, m, w in zip("qkv", mine_p, whole_p)
    }
    packed["packed_out"] = rel(got_p, at_rows(ref_p.detach()))
    whole_doc = document_positions(torch.tensor([0, s]), cp, rank)

    # the slices against megatron's get_batch_on_this_cp_rank: the batch and the RoPE angles
    from megatron.core.utils import get_batch_on_this_cp_rank

    from ftcore.data.cp import shard
    from ftcore.models.rope import pos_emb_on_this_cp_rank

    mb = make_microbatch([[Doc(np.arange(20, dtype=np.int32), np.ones(20, bool))], []], s, 0)
    ours = shard(mb, cp, rank)
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    theirs = get_batch_on_this_cp_rank({k: getattr(mb, k) for k in keys}, dist.group.WORLD)
    # megatron's get_pos_emb_on_this_cp_rank copies its index through pinned memory to CUDA (why
    # ftcore has its own): the angles must be those of the tokens megatron's batch slice keeps
    emb = torch.randn(s, 1, 1, d, generator=g)
    their_emb = get_batch_on_this_cp_rank({"emb": emb.transpose(0, 1)}, dist.group.WORLD)["emb"]
    same_emb = torch.equal(
        pos_emb_on_this_cp_rank(emb, 0, dist.group.WORLD), their_emb.transpose(0, 1)
    )

    return {
        "same_batch": all(torch.equal(getattr(ours, k), theirs[k]) for k in keys),
        # one unpadded document of the whole row: the per-document split is megatron's too
        "same_document_split": torch.equal(
            whole_doc,
            get_batch_on_this_cp_rank({"i": torch.arange(s)[None]}, dist.group.WORLD)["i"][0],
        ),
        **packed,
        "same_rope": same_emb,
        "shape": tuple(got.shape),
        "out": rel(got, ref.detach().index_select(0, idx)),
        **{
            f"d{n}": rel(m.grad, w.grad.index_select(0, idx)) for n, m, w in zip("qkv", mine, whole)
        },
    }
