"""Worker-side helpers for layout tests: build a run, feed synthetic batches, gather weights.

Synthetic global batches depend only on (seed, step), never on the layout: global batch k is a
fixed [global_batch, seq] block of rows with random loss masks (so per-token normalisation across
micro-batches and DP ranks matters); DP rank r takes its contiguous rows, cut into micro-batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from ftcore.config.schema import compose
from ftcore.data.pipeline import MicroBatch
from ftcore.models.builder import params_current
from ftcore.models.sharding import iter_params, join_shards, shard_info, unwrap
from ftcore.training import trainer
from tests.support.tiny import TINY


def global_batch(step: int, gbs: int, seq: int, vocab: int, seed: int = 0) -> list[MicroBatch]:
    """One MicroBatch per row of global batch `step`."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    toks = torch.randint(0, vocab, (gbs, seq + 1), generator=g)
    mask = (torch.rand(gbs, seq, generator=g) > 0.3).float()
    rows = []
    for i in range(gbs):
        rows.append(MicroBatch(
            tokens=toks[i : i + 1, :-1].clone(), labels=toks[i : i + 1, 1:].clone(),
            loss_mask=mask[i : i + 1].clone(),
            position_ids=torch.arange(seq).unsqueeze(0),
            segment_ids=torch.ones(1, seq, dtype=torch.int32), num_tokens=seq,
        ))  # fmt: skip
    return rows


def stack(rows: list[MicroBatch]) -> MicroBatch:
    cat = lambda name: torch.cat([getattr(r, name) for r in rows])  # noqa: E731
    return MicroBatch(cat("tokens"), cat("labels"), cat("loss_mask"), cat("position_ids"),
                      cat("segment_ids"), sum(r.num_tokens for r in rows))  # fmt: skip


class SyntheticLoader:
    def __init__(self, cfg, dp_rank: int, dp: int, vocab: int, seed: int = 0):
        self.cfg, self.dp_rank, self.dp, self.vocab, self.seed = cfg, dp_rank, dp, vocab, seed
        self.step = 0

    def next_microbatches(self) -> list[MicroBatch]:
        t = self.cfg.train
        rows = global_batch(
            self.step, t.global_batch_size, self.cfg.data.seq_len, self.vocab, self.seed
        )
        self.step += 1
        per = t.global_batch_size // self.dp
        mine = rows[self.dp_rank * per : (self.dp_rank + 1) * per]
        mbs = t.micro_batch_size
        return [stack(mine[i : i + mbs]) for i in range(0, per, mbs)]

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, d: dict) -> None:
        self.step = d["step"]


def build(overrides: list[str], run_dir: str):
    cfg = compose(TINY + list(overrides) + [f"run.dir={run_dir}"])
    state = trainer.setup(cfg, data=False)
    state.loader = SyntheticLoader(cfg, ps.get_data_parallel_rank(), state.dp, cfg.model.vocab_size)
    return state


def full_weights(state, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (TP-joined) tensors of the parameters this PP rank holds; empty on non-zero TP/DP ranks."""
    tp = ps.get_tensor_model_parallel_world_size()
    group = ps.get_tensor_model_parallel_group()
    out = {}
    for name, p in iter_params(state.model):
        if trainable_only and not p.requires_grad:
            continue
        data = p.detach().float().contiguous()
        shards = [torch.empty_like(data) for _ in range(tp)]
        dist.all_gather(shards, data, group=group)
        if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
            out[name] = join_shards(shards, shard_info(name, p, tp))
    return out


def train_and_collect(overrides: list[str], run_dir: str, steps: int = 5) -> dict:
    """Train `steps` steps; every rank returns losses, grad norms and its share of the weights."""
    state = build(overrides, run_dir)
    losses, norms = [], []
    for _ in range(steps):
        out = trainer.train_step(state)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    params_current(state.model)  # overlap_param_gather: the last update, gathered
    config, ddp = unwrap(state.model[0]).config, state.model[0].ddp_config
    flags = {  # what megatron ran with (the layout tests check the options reached it)
        "overlap_grad_reduce": ddp.overlap_grad_reduce,
        "overlap_param_gather": ddp.overlap_param_gather,
        "overlap_p2p_comm": config.overlap_p2p_comm,
        "batch_p2p_comm": config.batch_p2p_comm,
    }
    return {"loss": losses, "grad_norm": norms, "weights": full_weights(state), "flags": flags}


def merge_weights(results: list[dict]) -> dict[str, torch.Tensor]:
    merged = {}
    for r in results:
        merged.update(r["weights"])
    return merged


def recompute_case(overrides: list[str], run_dir: str, steps: int = 3) -> dict:
    from tests.support.planner_probe import peak_saved_bytes

    state = build(overrides, run_dir)
    first = peak_saved_bytes(state)  # peak of live saved tensors: what recompute lowers
    losses = [trainer.train_step(state)["loss"] for _ in range(steps)]
    return {"saved_bytes": first, "loss": losses}


def picked_rows_case(overrides: list[str], run_dir: str) -> dict:
    """Rows the output layer saw per micro-batch (and whether it ran with SP) in one step, against
    the micro-batches' target counts: the target-position logits path under this layout."""
    state = build(overrides, run_dir)
    chunk = unwrap(state.model[-1])
    seen = []
    if chunk.post_process:
        chunk.output_layer.register_forward_hook(
            lambda m, a, o: seen.append((a[0].shape[0] * a[0].shape[1], m.sequence_parallel))
        )
    mbs = record_microbatches(state)
    trainer.train_step(state)
    sp_after = chunk.output_layer.sequence_parallel if chunk.post_process else None
    targets = [int(mb.loss_mask.sum()) for mb in mbs]
    return {"seen": seen, "targets": targets, "sp_after": sp_after}


def record_microbatches(state) -> list[MicroBatch]:
    """A list that fills with every micro-batch the loader hands out from now on."""
    seen: list[MicroBatch] = []
    next_microbatches = state.loader.next_microbatches

    def recorded():
        mbs = next_microbatches()
        seen.extend(mbs)
        return mbs

    state.loader.next_microbatches = recorded
    return seen
