"""How megatron spreads transformer layers over pipeline ranks and virtual stages.

One pure function shared by the planner (per-stage memory) and the model builder (which layers a
rank builds), so the two can never disagree. Three ways, megatron's own (transformer_block.py
`get_num_layers_to_build`, transformer_layer.py `get_transformer_layer_offset`):

- even: layers that divide by pp*vp go pp*vp equal chunks;
- chosen stages (`parallel.pp_first_stage_layers` / `pp_last_stage_layers`, megatron's
  `num_layers_in_first/last_pipeline_stage`): the first and/or last pipeline rank holds the count
  given, the ranks between share the rest equally; under vp every rank's count divides by vp. How
  61-layer DeepSeek-V3 pipelines (pp=4 as 13+16+16+16: `first_stage_rule`, the planner's pick);
- otherwise megatron's `account_for_embedding_in_pipeline_split` / `account_for_loss_in_pipeline_split`
  count the embedding and the loss as one layer each: (num_layers + 2) must divide by pp*vp, the
  first chunk of pp rank 0 builds one layer fewer and the last chunk of the last pp rank one fewer.
"""

from __future__ import annotations

from typing import Optional

from ftcore.errors import FtcoreError

FIRST, LAST = "parallel.pp_first_stage_layers", "parallel.pp_last_stage_layers"


class LayerSplit(list):
    """Layers per [pp_rank][vp_stage] (a plain nested list) plus the megatron flags that make it.

    `offsets[pp_rank][vp_stage]` is the global index of the chunk's first layer. Chunks are laid out
    in megatron's order: vp stage 0 on pp ranks 0..pp-1, then vp stage 1, and so on.
    """

    account_for_embedding: bool = False
    account_for_loss: bool = False
    first: Optional[int] = None
    last: Optional[int] = None
    offsets: list[list[int]]

    def megatron_flags(self) -> dict:
        """TransformerConfig keyword arguments that make megatron build exactly this split."""
        if self.first is not None or self.last is not None:
            return {
                "num_layers_in_first_pipeline_stage": self.first,
                "num_layers_in_last_pipeline_stage": self.last,
            }
        if not (self.account_for_embedding or self.account_for_loss):
            return {}
        return {
            "account_for_embedding_in_pipeline_split": self.account_for_embedding,
            "account_for_loss_in_pipeline_split": self.account_for_loss,
        }

    def per_rank(self) -> list[int]:
        """Transformer layers held by each pipeline rank (all its virtual stages)."""
        return [sum(chunks) for chunks in self]


def split_for(cfg) -> LayerSplit:
    """The split a config asks for: model.num_layers over its parallel section."""
    p = cfg.parallel
    first, last = (
        getattr(p, "pp_first_stage_layers", None),
        getattr(p, "pp_last_stage_layers", None),
    )
    return split_layers(cfg.model.num_layers, p.pp, p.vp, first=first, last=last)


def split_layers(
    num_layers: int,
    pp: int,
    vp: int = 1,
    *,
    first: Optional[int] = None,
    last: Optional[int] = None,
) -> LayerSplit:
    """Layers per [pp_rank][vp_stage]; raises FtcoreError (naming the key and the fix) for a split
    megatron would refuse or assert on."""
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
    if first is not None or last is not None:
        per_rank = _chosen(num_layers, pp, vp, first, last)
        split = LayerSplit([[n // vp] * vp for n in per_rank])
        split.first, split.last = first, last
    else:
        split = _automatic(num_layers, pp, vp)
    offsets = [[0] * vp for _ in range(pp)]
    start = 0
    for v in range(vp):
        for r in range(pp):
            offsets[r][v] = start
            start += split[r][v]
    split.offsets = offsets
    return split


def _automatic(num_layers: int, pp: int, vp: int) -> LayerSplit:
    """Even, else the embedding and the loss counted as one layer each."""
    chunks = pp * vp
    if num_layers % chunks == 0:
        return LayerSplit([[num_layers // chunks] * vp for _ in range(pp)])
    if (num_layers + 2) % chunks:
        raise _no_split(num_layers, pp, vp)
    split = LayerSplit([[(num_layers + 2) // chunks] * vp for _ in range(pp)])
    split[0][0] -= 1
    split[pp - 1][vp - 1] -= 1
    split.account_for_embedding = split.account_for_loss = True
    return split


def _chosen(num_layers: int, pp: int, vp: int, first, last) -> list[int]:
    """Layers per pipeline rank with the first and/or last rank's count given (megatron's
    TransformerConfig checks, as FtcoreErrors)."""
    given = {FIRST: first, LAST: last}
    if pp == 1:
        key = FIRST if first is not None else LAST
        raise FtcoreError(
            f"{key} places layers on pipeline stages, and parallel.pp=1 has one",
            field=key,
            fix=f"set parallel.pp>1, or {key}=null",
        )
    for key, n in given.items():
        if n is None:
            continue
        if not 1 <= n < num_layers:
            raise FtcoreError(
                f"{key}={n}: a stage holds between 1 and {num_layers - 1} of the "
                f"model's {num_layers} layers",
                field=key,
                fix=f"set {key} between 1 and {num_layers - 1}, or null",
            )
        if n % vp:
            raise FtcoreError(
                f"{key}={n} does not divide into parallel.vp={vp} virtual stages",
                field=key,
                fix=f"use a multiple of {vp}",
            )
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    set_keys = " and ".join(k for k, n in given.items() if n is not None)
    if middle == 0 and rest != 0 or middle > 0 and (rest < middle or rest % (middle * vp)):
        share = f"{middle} stage(s) x parallel.vp={vp}" if middle else "no other stage"
        raise FtcoreError(
            f"{set_keys} leave {rest} of model.num_layers={num_layers} layers for {share}, "
            "which does not split evenly",
            field=FIRST if first is not None else LAST,
            fix=_fix(num_layers, pp, vp),
        )
    per = rest // middle if middle else 0
    return [
        first if r == 0 and first is not None else last if r == pp - 1 and last is not None else per
        for r in range(pp)
    ]


def first_stage_rule(num_layers: int, pp: int, vp: int = 1) -> Optional[int]:
    """The first stage's layer count the planner picks when no even split exists: the other stages
    share the rest equally, the largest stage is as small as can be, and on a tie the first stage
    holds fewer (it also holds the embedding and the most micro-batches in flight under 1F1B).
    None when no count works (or pp=1)."""
    best = None
    for n in range(vp, num_layers, vp):
        rest = num_layers - n
        if pp > 1 and rest >= pp - 1 and rest % ((pp - 1) * vp) == 0:
            key = (max(n, rest // (pp - 1)), n)
            best = min(best or key, key)
    return best[1] if best else None


def _fix(num_layers: int, pp: int, vp: int) -> str:
    n = first_stage_rule(num_layers, pp, vp)
    if n is not None:
        return f"e.g. {FIRST}={n} and {LAST}=null"
    return "choose counts so the stages between share the rest evenly (a multiple of parallel.vp)"


def _no_split(num_layers: int, pp: int, vp: int) -> FtcoreError:
    chunks = pp * vp
    hint = _fix(num_layers, pp, vp)
    return FtcoreError(
        f"model.num_layers={num_layers} does not split over parallel.pp={pp} x parallel.vp={vp} = "
        f"{chunks} chunks, neither evenly nor counting the embedding and the loss as one layer each "
        f"({num_layers + 2} layers)",
        field="model.num_layers",
        fix=f"choose parallel.pp x parallel.vp dividing {num_layers} or {num_layers + 2}, or "
        f"give the stages' layers ({FIRST}, {LAST}; {hint})",
    )
