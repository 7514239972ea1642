"""Expert parameters kept apart from the dense ones at every expert-parallel size.

megatron-core marks expert weights `allreduce=False` (reduced over the expert data-parallel
group, given their own optimizer in a ChainedOptimizer) only when ep > 1; at ep = 1 they join the
dense parameters' buffers and optimizer. A checkpoint's optimizer state is then nested one way at
ep = 2 ({0: dense, 1: experts}) and another at ep = 1 (one optimizer), and a run saved at ep = 2
cannot resume at ep = 1 x dp = 2 with its Adam state. Marked apart at ep = 1 too, the experts get
the same buffers, groups (the expert data-parallel group is then the data-parallel group) and
optimizer layout at every ep: the same arithmetic, one checkpoint layout (docs/moe.md).
"""

from __future__ import annotations


def experts_apart(chunks: list) -> int:
    """Mark every MoE layer's expert parameters `allreduce=False`; returns how many."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    n = 0
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, MoELayer):
                for p in module.experts.parameters():
                    p.allreduce = False
                    n += 1
    return n
