"""Decoding under any layout: the chat-templated prompt in, tokens out, greedily (temperature 0)
or sampled (temperature, top-k, top-p). Used by `ftcore.generate`, by the trainer's exact-match
accuracy (inference/exact_match.py) and by objective=grpo's rollouts (training/objectives/grpo/rollout.py: each
data-parallel replica decodes its own completions, each row from its own seeded generator).

Decoding runs megatron's own forward-only schedule, so TP/PP work unchanged. With megatron's KV
cache (StaticInferenceContext) the prompts are read once and each later forward feeds one new
position per row; under sequence or context parallelism (which shard the sequence) each step
recomputes the whole prefix instead: same tokens, O(length^2). The next tokens are chosen on the
last pipeline stage (full-vocab logits, padded vocab masked) and shared with every rank.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from ftcore.errors import FtcoreError
from ftcore.runtime import collectives
from ftcore.runtime import dist as rdist

log = logging.getLogger("ftcore")
STOP_TOKENS = ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "</s>")


def stop_ids(tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    vocab = tokenizer.get_vocab()
    return ids | {vocab[t] for t in STOP_TOKENS if t in vocab}


def _next_token_step(positions: torch.Tensor, vocab: int, data_iterator, model):
    """Forward one batch; on the last stage, full-vocab logits at each row's current position."""
    from ftcore.data.pipeline import attention_mask_from_segments
    from ftcore.runtime import cpu

    tokens = next(data_iterator)
    pos = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    mask = attention_mask_from_segments(torch.ones_like(tokens, dtype=torch.int32))
    device = next(model.parameters()).device
    with cpu.mode_suspended():
        out = model(tokens.to(device), pos.to(device), mask.to(device))

    def pick(output):
        rows = output[torch.arange(output.shape[0]), positions.to(output.device)]  # [b, v/tp]
        full = tensor_parallel.gather_from_tensor_model_parallel_region(rows.float())[:, :vocab]
        return torch.zeros(()), torch.tensor(1, dtype=torch.int), {"logits": full.detach()}

    return out, pick


def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The logits with every token outside the nucleus at -inf: the nucleus is the fewest most
    likely tokens whose probability reaches `top_p` (nucleus sampling; transformers' TopPLogitsWarper
    keeps the same set). top_p >= 1 keeps every token."""
    if top_p >= 1:
        return logits
    ranked, order = logits.sort(-1, descending=True)
    probs = ranked.softmax(-1)
    drop = probs.cumsum(-1) - probs >= top_p  # the tokens before it already reach top_p
    drop[..., 0] = False  # the most likely token always stays
    ranked = ranked.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, ranked)


def _choose(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
            gen: torch.Generator | list) -> torch.Tensor:  # fmt: skip
    """Greedy at temperature 0; else temperature, then top-k, then top-p (transformers' order).
    `gen`: one generator for the batch, or one per row (None: the row's choice is not taken, and
    draws nothing), so what a row samples depends on its own generator alone."""
    if temperature <= 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    logits = nucleus(logits, top_p)
    probs = logits.softmax(-1).cpu()
    if not isinstance(gen, list):
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    out = torch.zeros(len(gen), dtype=torch.int64)
    for j, g in enumerate(gen):
        if g is not None:
            out[j] = torch.multinomial(probs[j], 1, generator=g)[0]
    return out


def _share(ids: torch.Tensor, chooser: bool, group=None) -> torch.Tensor:
    """The chooser rank's tokens on every rank of `group` (default the world; others add
    zeros), on the host."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return ids.to(torch.int64).cpu()
    t = ids if chooser else torch.zeros_like(ids)
    t = t.to(device=rdist.comm_device(), dtype=torch.int64)
    collectives.all_reduce(t, group=group)
    return t.cpu()


def kv_cache_applies(cfg) -> bool:
    """The KV cache needs one new position per forward: sequence parallelism shards the sequence
    over TP ranks (a 1-token step cannot split) and context parallelism shards it over CP ranks,
    so those layouts keep recomputing the prefix (same tokens, O(length^2))."""
    return not cfg.parallel.sp and cfg.parallel.cp == 1


def _forward(state, step, width: int, batch: int, tokens: torch.Tensor):
    """megatron's forward-only schedule over one micro-batch of `tokens`: the last stage's dict."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ftcore.data.packing import microbatch_iterators
    from ftcore.runtime import cpu

    with cpu.device_mode():
        res = get_forward_backward_func()(
            forward_step_func=step, data_iterator=microbatch_iterators([tokens], len(state.model)),
            model=state.model if len(state.model) > 1 else state.model[0], num_microbatches=1,
            seq_length=width, micro_batch_size=batch, forward_only=True,
        )  # fmt: skip
    return res[0] if res else None


def _cached_step(context, vocab: int, data_iterator, model):
    """Forward only the new positions; attention reads the earlier ones from `context`'s cache
    (megatron's StaticInferenceContext: keys and values per layer, written at its offset)."""
    from ftcore.runtime import cpu

    tokens = next(data_iterator)
    start, width = context.sequence_len_offset, tokens.shape[1]
    pos = torch.arange(start, start + width).unsqueeze(0).expand_as(tokens)
    # True = masked out: the new queries see every cached key and, causally, each other
    mask = torch.ones(width, start + width, dtype=torch.bool).triu(start + 1)[None, None]
    device = next(model.parameters()).device
    with cpu.mode_suspended():  # megatron's inference path gathers the TP logits itself
        out = model(tokens.to(device), pos.to(device), mask.to(device), inference_context=context,
                    runtime_gather_output=True)  # fmt: skip

    def pick(output):  # only the last position's logits are materialised: [b, 1, padded vocab]
        full = output[:, -1, :vocab].float().detach()
        return torch.zeros(()), torch.tensor(1, dtype=torch.int), {"logits": full}

    return out, pick


def _decode_cached(state, tokens, lengths, *, max_new_tokens, choose, finish) -> None:
    """All rows advance one position per forward from the shortest prompt on, with a KV cache:
    a row still inside its prompt is fed its prompt token (its choice is ignored), the others their
    chosen token. Finished rows leave the batch and the cache. `choose(logits, rows, live)` picks
    for every row fed this step (`rows`: their indices; `live`: whether each one's choice is
    taken); `finish(i, tok)` takes row i's new token and says whether row i is done."""
    from megatron.core.inference.contexts import StaticInferenceContext

    n, total = tokens.shape[0], int(lengths.max()) + max_new_tokens
    context = StaticInferenceContext(max_batch_size=n, max_sequence_length=total)
    active = torch.arange(n)
    at = int(lengths.min())  # the position filled next
    feed = tokens[:, :at]
    while len(active) and at < total:
        step = partial(_cached_step, context, state.cfg.model.vocab_size)
        res = _forward(state, step, feed.shape[1], len(active), feed)
        rows = active.tolist()
        live = [at >= lengths[i] for i in rows]
        picked = choose(res["logits"] if res else None, rows, live)
        context.sequence_len_offset += feed.shape[1]
        left = []
        for j, i in enumerate(rows):
            if at < lengths[i]:  # still reading its prompt
                left.append(j)
            elif not finish(i, int(picked[j])) and at + 1 < lengths[i] + max_new_tokens:
                tokens[i, at] = int(picked[j])
                left.append(j)
        if len(left) < len(active):
            keep = torch.tensor(left, dtype=torch.long)
            for layer, (k, v) in list(context.key_value_memory_dict.items()):
                context.key_value_memory_dict[layer] = (
                    k[:, keep.to(k.device)],
                    v[:, keep.to(v.device)],
                )
            active = active[keep]
        feed = tokens[active, at : at + 1]
        at += 1


@torch.no_grad()
def generate_ids(state, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, stop: set[int] = frozenset(), pad_id: int = 0,
                 seed: int = 0, keep=None, kv_cache: bool = True, seeds: list[int] | None = None,
                 group=None, keep_stop: bool = False) -> list[list[int]]:  # fmt: skip
    """New token ids for each prompt (stop token excluded unless `keep_stop`). Every rank calls
    this with the same prompts and gets the same answers. `keep(i, ids)` False ends row i early
    (exact match: the answer can no longer match). With `kv_cache` (where `kv_cache_applies`) each
    forward feeds only the new position; without it each recomputes the whole prefix.

    `seeds` (one per prompt): row i samples from its own generator, seeded with seeds[i], which
    draws once per token the row takes: its tokens do not depend on the other rows, the batch or
    the layout. `group`: the ranks that decode these prompts together (one model replica: its
    model-parallel group); the replica's last stage, TP rank 0 chooses and shares with it.
    Default: the world, the chooser being DP rank 0's."""
    cfg = state.cfg
    vocab = cfg.model.vocab_size
    multiple = cfg.parallel.tp if cfg.parallel.sp else 1
    chooser = (
        ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0
    )
    if group is None:
        chooser = chooser and ps.get_data_parallel_rank() == 0
    gen = torch.Generator().manual_seed(seed)
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds] if seeds is not None else None
    lengths = torch.tensor([len(p) for p in prompts])
    total = int(lengths.max()) + max_new_tokens
    if total > cfg.model.max_position_embeddings:
        raise FtcoreError(f"prompt + max_new_tokens = {total} exceeds the model's {cfg.model.max_position_embeddings} "
                          "positions", field="generate.max_new_tokens",
                          fix="a shorter prompt or fewer generate.max_new_tokens")  # fmt: skip
    tokens = torch.full((len(prompts), total + multiple), pad_id, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p)
    done = torch.zeros(len(prompts), dtype=torch.bool)
    out: list[list[int]] = [[] for _ in prompts]

    def choose(logits, rows: list[int], live: list[bool]) -> torch.Tensor:
        if not chooser:
            return _share(torch.zeros(len(rows)), False, group)
        g = gen if gens is None else [gens[i] if ok else None for i, ok in zip(rows, live)]
        return _share(_choose(logits, temperature, top_k, top_p, g), True, group)

    def finish(i: int, tok: int) -> bool:
        if tok in stop:
            if keep_stop:
                out[i].append(tok)
            return True
        out[i].append(tok)
        return keep is not None and not keep(i, out[i])

    for chunk in state.model:
        chunk.eval()
    try:
        if kv_cache and kv_cache_applies(cfg):
            _decode_cached(state, tokens, lengths, max_new_tokens=max_new_tokens, choose=choose,
                           finish=finish)  # fmt: skip
            return out
        for t in range(max_new_tokens):
            active = (~done).nonzero().flatten()  # finished rows leave the batch
            if not len(active):
                break
            cur = lengths[active] + t  # positions to fill; the logits come from the one before
            width = -(-int(cur.max()) // multiple) * multiple
            step = partial(_next_token_step, cur - 1, vocab)
            res = _forward(state, step, width, len(active), tokens[active, :width])
            rows = active.tolist()
            picked = choose(res["logits"] if res else None, rows, [True] * len(rows))
            for j, i in enumerate(rows):
                tok = int(picked[j])
                done[i] = finish(i, tok)
                if not done[i]:
                    tokens[i, cur[j]] = tok
    finally:
        for chunk in state.model:
            chunk.train()
    return out


def prompt_ids(state, text: str, system: str | None = None) -> list[int]:
    """The ids of `text` as a user turn (after a `system` turn when given: the system prompt the
    adapter was trained with), through the chat template up to the assistant's header."""
    from ftcore.data.templates import Renderer

    renderer = Renderer(state.tokenizer, "instruction", state.cfg.data.chat_template)
    ids, _ = renderer.prompt({"instruction": text, "output": "", "system": system})
    return ids
