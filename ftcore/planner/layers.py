"""How megatron spreads transformer layers over pipeline ranks and virtual stages.

One pure function shared by the planner (per-stage memory) and the model builder (which layers a
rank builds), so the two can never disagree. Layers that divide by pp*vp are split evenly. Otherwise
megatron's `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split` count the
embedding and the loss as one layer each: (num_layers + 2) must divide by pp*vp, the first chunk of
pp rank 0 builds one layer fewer (it holds the embedding) and the last chunk of the last pp rank
builds one layer fewer (it holds the output layer and the loss).
"""

from __future__ import annotations

from ftcore.errors import FtcoreError


class LayerSplit(list):
    """Layers per [pp_rank][vp_stage] (a plain nested list) plus the two megatron flags.

    `offsets[pp_rank][vp_stage]` is the global index of the chunk's first layer. Chunks are laid out
    in megatron's order: vp stage 0 on pp ranks 0..pp-1, then vp stage 1, and so on.
    """

    account_for_embedding: bool
    account_for_loss: bool
    offsets: list[list[int]]

    def megatron_flags(self) -> dict:
        """TransformerConfig keyword arguments that make megatron build exactly this split."""
        if not (self.account_for_embedding or self.account_for_loss):
            return {}
        return {
            "account_for_embedding_in_pipeline_split": self.account_for_embedding,
            "account_for_loss_in_pipeline_split": self.account_for_loss,
        }

    def per_rank(self) -> list[int]:
        """Transformer layers held by each pipeline rank (all its virtual stages)."""
        return [sum(chunks) for chunks in self]


def split_layers(num_layers: int, pp: int, vp: int = 1) -> LayerSplit:
    """Layers per [pp_rank][vp_stage]; raises FtcoreError when neither the even nor the
    embedding+loss-counted split divides."""
    if num_layers < 1 or pp < 1 or vp < 1:
        raise FtcoreError(
            f"need num_layers, pp and vp >= 1 (got {num_layers}, {pp}, {vp})",
            field="parallel.pp",
            fix="use positive sizes",
        )
    if vp > 1 and pp == 1:
        raise FtcoreError(
            "interleaving (vp > 1) needs pipeline parallelism (pp > 1)",
            field="parallel.vp",
            fix="set parallel.vp=1 or parallel.pp>1",
        )
    chunks = pp * vp
    emb = loss = False
    if num_layers % chunks == 0:
        per_chunk = num_layers // chunks
    elif (num_layers + 2) % chunks == 0:
        emb = loss = True
        per_chunk = (num_layers + 2) // chunks
        if per_chunk < 1:
            raise _no_split(num_layers, pp, vp)
    else:
        raise _no_split(num_layers, pp, vp)
    split = LayerSplit([[per_chunk] * vp for _ in range(pp)])
    if emb:
        split[0][0] -= 1
    if loss:
        split[pp - 1][vp - 1] -= 1
    offsets = [[0] * vp for _ in range(pp)]
    start = 0
    for v in range(vp):
        for r in range(pp):
            offsets[r][v] = start
            start += split[r][v]
    split.account_for_embedding = emb
    split.account_for_loss = loss
    split.offsets = offsets
    return split


def _no_split(num_layers: int, pp: int, vp: int) -> FtcoreError:
    chunks = pp * vp
    return FtcoreError(
        f"model.num_layers={num_layers} does not split over parallel.pp={pp} x parallel.vp={vp} = "
        f"{chunks} chunks, neither evenly nor counting the embedding and the loss as one layer each "
        f"({num_layers + 2} layers)",
        field="model.num_layers",
        fix=f"choose parallel.pp x parallel.vp dividing {num_layers} or {num_layers + 2}",
    )
