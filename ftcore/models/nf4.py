"""QLoRA's frozen base: megatron's column/row-parallel linears with their weight stored as NF4
(bitsandbytes, optionally with double quantisation of the block constants).

The full-precision base is never held. With a weights source (model.hf_path / init_path) the layer
spec builds `NF4Column`/`NF4Row` in place of megatron's linears: they allocate nothing, only a
`weight` on the meta device that tells the loader (hf/io.py) this rank's shard shape, TP axis and
where to assemble it. The loader reads each shard, hands it whole to `quantize_`, and drops it, so
a rank holds the NF4 base plus one full-precision shard at a time. A randomly initialised base
(no weights source) is built in full precision and quantised afterwards (`quantize_linear`).

Each TP rank quantises its own shard, in the blocks one process would use: NF4 blocks are 64
consecutive values of a weight's rows, so a row-parallel shard whose columns do not start and end
on a block (ffn 704 at TP=2: 352 columns) is quantised as the slab of whole blocks around it
(`window`, read whole by the loader: at most a block more per row on each side) and sliced after
dequantising. Every element then has its one-process absmax, so TP changes nothing (with
double quantisation off: its groups of 256 block constants follow the shard). A width that is not
a whole number of blocks at all is refused at TP > 1 (peft/config.py), where no slab can help.
The forward dequantises the shard to the compute dtype
(fp32/bf16) and does what megatron's linear does around the GEMM: column-parallel input copied into
the TP region (all-gathered along the sequence with SP), row-parallel output all-reduced
(reduce-scattered along the sequence with SP). The weight gets no gradient; the input does, so
adapters upstream still train.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from torch import nn

from ftcore.errors import FtcoreError

log = logging.getLogger("ftcore")
BLOCKSIZE = 64  # peft/config.py's NF4_BLOCK (torch-free) says the same


def _bnb():
    try:
        import bitsandbytes.functional as bnbf
    except ImportError as e:
        raise FtcoreError("peft=qlora needs bitsandbytes", field="peft.name",
                          fix="pip install bitsandbytes (it is in ftcore's test extra), or use peft=lora") from e  # fmt: skip
    return bnbf


def block_window(width: int, tp: int, tp_rank: int) -> tuple[int, int] | None:
    """The full weight's columns [a, b) whose whole NF4 blocks hold a row-parallel shard's columns
    (width each, TP rank tp_rank of tp), or None where the shard is whole blocks itself."""
    c0, c1 = tp_rank * width, (tp_rank + 1) * width
    a, b = c0 // BLOCKSIZE * BLOCKSIZE, -(-c1 // BLOCKSIZE) * BLOCKSIZE
    return None if (a, b) == (c0, c1) else (a, min(b, width * tp))


class NF4ParallelLinear(nn.Module):
    """A frozen NF4 megatron ColumnParallelLinear/RowParallelLinear (no bias).

    Until `quantize_` it holds only `weight` on meta (shape, dtype, TP attributes of the shard;
    `whole_device` and `take_whole` tell the loader where to assemble the shard and whom to give it,
    `nf4_cols` which columns of the full weight to read: `window`); afterwards only `qweight`, the
    packed NF4 shard (or slab)."""

    def __init__(self, shape, dtype, device, *, column: bool, sp: bool, double_quant: bool):
        super().__init__()
        self.column, self.sp, self.double_quant = column, sp, double_quant
        self.dtype, self.shape, self.device = dtype, tuple(shape), torch.device(device)
        self.quant_state = None
        self.register_parameter("qweight", None)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        self.window = None
        if not column and tp > 1:
            rank = parallel_state.get_tensor_model_parallel_rank()
            self.window = block_window(self.shape[1], tp, rank)
            self.offset = rank * self.shape[1] - self.window[0] if self.window else 0
        w = nn.Parameter(torch.empty(self.shape, dtype=dtype, device="meta"), requires_grad=False)
        set_tensor_model_parallel_attributes(w, True, 0 if column else 1, 1)
        w.whole_device, w.take_whole, w.nf4_cols = self.device, self.quantize_, self.window
        self.weight = w

    @property
    def stored_shape(self) -> tuple[int, int]:
        """What is quantised: the shard, or the slab of whole blocks around it."""
        if self.window is None:
            return self.shape
        return (self.shape[0], self.window[1] - self.window[0])

    @torch.no_grad()
    def quantize_(self, w: torch.Tensor) -> None:
        """Store `w` (this rank's whole shard, or the slab `window` of the full weight) as NF4
        and drop the placeholder weight."""
        if w.is_meta and tuple(w.shape) == self.shape:  # a dry build: nothing to read
            w = torch.empty(self.stored_shape, dtype=w.dtype, device="meta")
        if tuple(w.shape) != self.stored_shape:
            raise RuntimeError(f"NF4 linear of shape {self.stored_shape} handed {tuple(w.shape)}")
        placeholder = self._parameters.pop("weight")
        bnbf = _bnb()
        if w.is_meta and self.double_quant and "dynamic" not in bnbf.name2qmap:
            # bitsandbytes caches the code table of double quantisation on the device of the first
            # tensor it sees: made on meta (a dry build) it would break every later real one
            bnbf.name2qmap["dynamic"] = bnbf.create_dynamic_map()
        packed, self.quant_state = bnbf.quantize_4bit(
            w.contiguous(), blocksize=BLOCKSIZE, compress_statistics=self.double_quant,
            quant_type="nf4",
        )  # fmt: skip
        q = nn.Parameter(packed, requires_grad=False)
        q.logical_numel = self.shape[0] * self.shape[1]  # what the model has, for the count
        q.tensor_model_parallel = placeholder.tensor_model_parallel
        q.partition_dim = placeholder.partition_dim
        self.qweight = q

    def _apply(self, fn, recurse=True):
        """`.cuda()`/`.to()` move the NF4 data; the meta placeholder stays on meta (it has none)."""
        placeholder = self._parameters.pop("weight", None)
        try:
            return super()._apply(fn, recurse)
        finally:
            if placeholder is not None:
                self._parameters["weight"] = placeholder

    def weight_fp(self) -> torch.Tensor:
        w = _bnb().dequantize_4bit(self.qweight.data, self.quant_state).to(self.dtype)
        w = w.view(self.stored_shape)
        if self.window is not None:
            w = w[:, self.offset : self.offset + self.shape[1]]
        return w

    def forward(self, x: torch.Tensor, *args, **kwargs):
        if self.qweight is None:
            raise RuntimeError("an NF4 linear was never handed its weights (hf/io.py load_weights)")
        w = self.weight_fp()
        if self.column:
            if self.sp:
                x = tensor_parallel.gather_from_sequence_parallel_region(
                    x, tensor_parallel_output_grad=True
                )
            else:
                x = tensor_parallel.copy_to_tensor_model_parallel_region(x)
            return F.linear(x, w.to(x.dtype)), None
        out = F.linear(x, w.to(x.dtype))
        if self.sp:
            return tensor_parallel.reduce_scatter_to_sequence_parallel_region(out), None
        return tensor_parallel.reduce_from_tensor_model_parallel_region(out), None

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata=None
    ) -> dict:
        return {}  # the frozen base comes back from model.hf_path / init_path, never from a checkpoint


class _Deferred(NF4ParallelLinear):
    """Built by megatron from the layer spec with a linear's arguments; allocates no weight."""

    COLUMN = True

    def __init__(self, input_size: int, output_size: int, *, config, double_quant: bool,
                 bias: bool = False, **_):  # fmt: skip
        if bias:
            raise FtcoreError("QLoRA supports linears without bias only", field="peft.name",
                              fix="peft=lora on this base (its linears have biases)")  # fmt: skip
        tp = parallel_state.get_tensor_model_parallel_world_size()
        col = self.COLUMN
        shape = (output_size // tp, input_size) if col else (output_size, input_size // tp)
        # where megatron would put the weight (the CPU, a GPU, or meta in a dry build)
        device = torch.empty(0, device="cpu" if config.use_cpu_initialization
                             else torch.cuda.current_device()).device  # fmt: skip
        sp = bool(config.sequence_parallel) and tp > 1
        super().__init__(shape, config.params_dtype, device, column=col, sp=sp,
                         double_quant=double_quant)  # fmt: skip


class NF4Column(_Deferred):
    COLUMN = True


class NF4Row(_Deferred):
    COLUMN = False


def defer_base_linears(spec, double_quant: bool) -> None:
    """Make a local layer spec build its four linears as NF4 placeholders (no full-precision weight)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    params = {"double_quant": double_quant}
    attn.linear_qkv = ModuleSpec(module=NF4Column, params=params)
    attn.linear_proj = ModuleSpec(module=NF4Row, params=params)
    mlp.linear_fc1 = ModuleSpec(module=NF4Column, params=params)
    mlp.linear_fc2 = ModuleSpec(module=NF4Row, params=params)


def quantize_linear(base: nn.Module, *, double_quant: bool, sp: bool) -> nn.Module:
    """The NF4 form of one megatron linear (column: linear_qkv/linear_fc1). A placeholder the loader
    already quantised is returned as it is; one never loaded is quantised only on meta (dry build)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    if isinstance(base, NF4ParallelLinear):
        if base.qweight is None:
            if not base.weight.is_meta or base.device.type != "meta":
                raise RuntimeError("an NF4 linear was never handed its weights")
            base.quantize_(base.weight)  # a dry build: meta in, meta out
        return base
    if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
        raise FtcoreError(f"QLoRA needs megatron's local linears, got {type(base).__name__}", field="peft.name",
                          fix="QLoRA builds with the local layer spec (precision.te_layers is ignored)")  # fmt: skip
    if getattr(base, "bias", None) is not None and base.bias.numel():
        raise FtcoreError("QLoRA supports linears without bias only", field="peft.name",
                          fix="peft=lora on this base (its linears have biases)")  # fmt: skip
    w = base.weight.detach()
    m = NF4ParallelLinear(w.shape, w.dtype, w.device, column=isinstance(base, ColumnParallelLinear),
                          sp=sp, double_quant=double_quant)  # fmt: skip
    if m.window is not None and not w.is_meta:  # the slab's other columns live on TP neighbours
        full = tensor_parallel.gather_from_tensor_model_parallel_region(w)
        w = full[:, m.window[0] : m.window[1]].contiguous()
        del full
    m.quantize_(w)
    m.qweight.tensor_model_parallel = bool(getattr(base.weight, "tensor_model_parallel", False))
    m.qweight.partition_dim = getattr(base.weight, "partition_dim", -1)
    return m
