"""Read single parameters (one layer at a time) out of a megatron dist_checkpointing checkpoint in
one process, without rebuilding the model or loading the whole checkpoint.

megatron's torch_dist format is PyTorch DCP: `.metadata` lists every tensor by key with its global
shape and the chunks each rank saved. Model keys are layout-independent: `module.` + the parameter
name, with the layers of the decoder stacked on a leading axis (`module.decoder.layers.mlp.
linear_fc1.weight` is [num_layers, 2*ffn, hidden]; fc1's saved global layout is [gate; up]). A read
names a region (offsets, sizes) and DCP's own resharding picks the chunks that cover it.

A model whose layers differ (MoE with dense layers) is saved per layer (`decoder.layers.<i>.`),
not stacked; a MoE layer's routed experts are one key with a leading expert axis
(`...mlp.experts.experts.linear_fc1.weight` is [num_experts, 2*moe_ffn, hidden], whichever EP rank
saved each), read one expert at a time.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")
# megatron's local spec saves its norms under Transformer Engine's names
ALIASES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


class _Targets:
    """The two planner calls FileSystemReader.read_data makes: where each read item lands."""

    def __init__(self, bufs: dict[str, torch.Tensor]):
        self.bufs = bufs

    def resolve_tensor(self, item):
        t = self.bufs[item.dest_index.fqn]
        for dim, (off, n) in enumerate(zip(item.dest_offsets, item.lengths)):
            t = t.narrow(dim, off, n)
        return t

    def commit_tensor(self, item, tensor) -> None:
        pass

    def load_bytes(self, item, value) -> None:
        pass


class CheckpointReader:
    def __init__(self, step_dir: str | Path):
        self.dir = Path(step_dir)
        if not (self.dir / ".metadata").is_file():
            raise FtcoreError(f"{self.dir} is not a dist_checkpointing checkpoint (no .metadata)",
                              field="export.checkpoint", fix="point it at checkpoints/step_<N> of a run")  # fmt: skip
        self.reader = safe_files.reader(self.dir, field="export.checkpoint")
        self.md = self.reader.read_metadata()  # data only: a pickle that names code is refused
        try:
            self.reader.set_up_storage_reader(self.md, True)
        except TypeError:
            self.reader.set_up_storage_reader(self.md, True, rank=0, use_collectives=False)
        self.tensors = {
            k: v for k, v in self.md.state_dict_metadata.items() if hasattr(v, "chunks")
        }

    def _key(self, name: str) -> tuple[str, tuple[int, ...]]:
        """(checkpoint key, indices along its leading axes) of a global parameter name: the layer
        of a stacked key, the expert of an experts key."""
        m = _LAYER.match(name)
        layer, rest = (int(m.group(1)), m.group(2)) if m else (None, name)
        e = _EXPERT.match(rest) if m else None
        lead: tuple[int, ...] = (int(e.group(1)),) if e else ()
        if e:
            rest = "mlp.experts.experts." + e.group(2)
        candidates = [rest] + ([ALIASES[rest]] if rest in ALIASES else [])
        candidates += [k for k, v in ALIASES.items() if v == rest]
        stems = (
            [("decoder.layers.", (layer,)), (f"decoder.layers.{layer}.", ())] if m else [("", ())]
        )
        for c in candidates:
            for stem, at in stems:
                for prefix in ("module.", ""):
                    key = prefix + stem + c
                    if key in self.tensors:
                        return key, at + lead
        raise KeyError(name)

    def has(self, name: str) -> bool:
        try:
            self._key(name)
            return True
        except KeyError:
            return False

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        """(full shape of the parameter, dtype) as saved."""
        key, lead = self._key(name)
        md = self.tensors[key]
        return tuple(md.size)[len(lead) :], md.properties.dtype

    def read(self, name: str) -> torch.Tensor:
        """The full tensor of one parameter (one layer's / expert's slice of a stacked key)."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        key, lead = self._key(name)
        md = self.tensors[key]
        size = tuple(md.size)
        offsets = [0] * len(size)
        sizes = list(size)
        for axis, index in enumerate(lead):
            offsets[axis], sizes[axis] = index, 1
        buf = torch.empty(sizes, dtype=md.properties.dtype)
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, md, [chunk])
        covered = sum(int(torch.Size(i.lengths).numel()) for i in items)
        if covered != buf.numel():
            raise FtcoreError(f"{self.dir}: the saved chunks of {key} do not cover {name}",
                              field="export.checkpoint", fix="the checkpoint is incomplete")  # fmt: skip
        plan = self.reader.prepare_local_plan(LoadPlan(items))
        plan = self.reader.prepare_global_plan([plan])[0]
        self.reader.read_data(plan, _Targets({key: buf})).wait()
        return buf.reshape(size[len(lead) :])
