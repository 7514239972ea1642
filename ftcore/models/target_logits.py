"""The output layer at target positions only.

Fine-tuning data trains on responses: in the bundled instruction set 15% of the tokens are
targets. Logits at the other positions feed a cross entropy that the loss mask multiplies by zero,
yet they cost a [tokens x hidden x vocab] GEMM forward and backward, several passes over
[tokens x vocab] in the loss, and in the last layer the MLP, the attention's queries and output
projection, whose outputs feed nothing else there. So the
last stage computes the last layer from its attention's queries on at the target positions only
([n, 1, h]; keys and values still need every position), or where that cannot be done from its MLP
on, or else from the output layer on; the loss gathers labels and mask the same way: the same sum
over the same targets, and the same gradients (the gather's backward scatters them back into
[s, b, h]).

Under sequence parallelism a rank holds a chunk of the sequence: the output layer's input is
all-gathered first (its backward takes this rank's chunk of a gradient that the output layer's TP
copy has already summed), picked, and the output layer runs without SP for that call, as
megatron's inference path does; the last MLP stays at every position there. Under context
parallelism each rank picks the targets among its own positions (its loss mask is sharded like
its tokens, data/cp.py), from the last MLP on: the CP attention attends every local query.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region


def applies(chunk) -> bool:
    """This chunk computes logits (a CP rank's rows are its own positions' targets)."""
    return bool(chunk.post_process)


def rows_of(loss_mask: torch.Tensor) -> torch.Tensor:
    """Indices of the target positions in the flattened [s, b] order of megatron's hidden states
    (loss_mask is [b, s]); at least one row, so an all-padding micro-batch keeps its shapes."""
    rows = loss_mask.t().reshape(-1).nonzero().squeeze(1)
    return rows if rows.numel() else rows.new_zeros(1)


def widest(loss_mask: torch.Tensor) -> int:
    """The most target rows of one sequence (at least 1, as rows_of keeps one row): the width of
    attention.attention_at_rows' grid, counted on the host mask so the GPU is not read for it."""
    return max(1, int((loss_mask != 0).sum(1).max())) if loss_mask.numel() else 1


def at_rows(t: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """A [b, s] tensor (labels, loss mask) at the selected positions, as [1, n] like the logits."""
    return t.t().reshape(-1).index_select(0, rows.to(t.device)).unsqueeze(0)


def _pick(hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[s, b, h] -> [n, 1, h] at the flattened positions `rows`."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return flat.index_select(0, rows.to(hidden.device)).unsqueeze(1)


def _mlp_can_pick(chunk) -> bool:
    """The last layer's MLP may run at the targets only unless full recompute reruns the layer
    after `only_at` has ended, FP8/FP4 GEMMs need the token count in multiples of 16, sequence
    parallelism splits the sequence among the TP ranks there, or it is a mixture of experts
    (its router balances, and counts, every token: docs/moe.md)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    c = chunk.config
    layers = chunk.decoder.layers if chunk.decoder is not None else []
    if len(layers) > 0 and isinstance(layers[-1].mlp, MoELayer):
        return False
    fp4 = getattr(c, "fp4", None)
    quant = c.fp8 or fp4
    return (
        len(layers) > 0
        and c.recompute_granularity != "full"
        and not quant
        and not c.sequence_parallel
    )


def _attention_can_pick(chunk) -> bool:
    """Also the last layer's attention: when its core attention can serve `query_rows` (ftcore's
    SdpaAttention, not Transformer Engine's), no recompute reruns it after `only_at` has ended, and
    its residual add is a plain function that can be wrapped."""
    last = chunk.decoder.layers[-1]
    core = getattr(last.self_attention, "core_attention", None)
    return (
        _mlp_can_pick(chunk)
        and chunk.config.recompute_granularity is None
        and hasattr(core, "query_rows")
        and not getattr(chunk.config, "attention_output_gate", False)
        and not isinstance(last.self_attn_bda, torch.nn.Module)
    )


def _install_attention(chunk) -> None:
    """The last layer's core attention at the rows (attention.attention_at_rows), its output
    projection on [n, 1, h], and the residual picked to match in its bias-dropout-add."""
    last = chunk.decoder.layers[-1]
    core = last.self_attention.core_attention
    forward_attention, bda = last._forward_attention, last.self_attn_bda

    def picked_attention(hidden_states, *args, **kwargs):
        pick = chunk._ftcore_pick
        if pick is None or pick["done"]:
            return forward_attention(hidden_states, *args, **kwargs)
        core.query_rows, core.query_width, core.rows_done = pick["rows"], pick["width"], False
        try:
            out = forward_attention(hidden_states, *args, **kwargs)
        finally:
            core.query_rows = core.query_width = None
        pick["done"] = core.rows_done  # else (too many scores) the MLP picks
        return out

    def picked_bda(training, fused):
        add = bda(training, fused)

        def add_at_rows(x_with_bias, residual, prob):
            if core.query_rows is not None and core.rows_done:
                residual = _pick(residual, core.query_rows)
            return add(x_with_bias, residual, prob)

        return add_at_rows

    last._forward_attention, last.self_attn_bda = picked_attention, picked_bda


def install(chunk) -> None:
    """Hooks that read the rows `only_at` sets: the last layer from its attention's queries on (or
    from its MLP on) runs at [n, 1, h] where it can; otherwise the output layer's input is picked."""
    chunk._ftcore_pick = None

    def output_layer_hook(module, args, kwargs):
        pick = chunk._ftcore_pick
        if pick is None or pick["done"]:
            return None
        pick["done"] = True
        hidden = args[0]
        if module.sequence_parallel:  # only_at turns it back on
            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
            module.sequence_parallel, pick["restore_sp"] = False, True
        return (_pick(hidden, pick["rows"]), *args[1:]), kwargs

    chunk.output_layer.register_forward_pre_hook(output_layer_hook, with_kwargs=True)
    if not _mlp_can_pick(chunk):
        return
    last = chunk.decoder.layers[-1]
    forward_mlp = last._forward_mlp

    def picked_mlp(hidden_states, *args, **kwargs):
        pick = chunk._ftcore_pick
        if pick is not None and not pick["done"]:
            pick["done"] = True
            hidden_states = _pick(hidden_states, pick["rows"])
        return forward_mlp(hidden_states, *args, **kwargs)

    last._forward_mlp = picked_mlp
    if _attention_can_pick(chunk):
        _install_attention(chunk)


@contextmanager
def only_at(chunk, rows: torch.Tensor | None, width: int | None = None):
    """Logits at `rows` only during this forward (None: every position); width: `widest` of the
    micro-batch's loss mask, if known (else attention reads it from the device)."""
    if rows is None or not chunk.post_process:
        yield
        return
    pick = chunk._ftcore_pick = {"rows": rows, "width": width, "done": False}
    try:
        yield
    finally:
        chunk._ftcore_pick = None
        if pick.get("restore_sp"):
            chunk.output_layer.sequence_parallel = True
