"""Stream Hugging Face safetensors in (only this rank's rows/columns) and out (tensor by tensor).

Loading never builds a full model in one process: for every parameter a rank holds, the mapping
(hf/mappings.py) names the rows/columns of the HF tensors that make its TP shard, and
`safe_open(...).get_slice` copies just those bytes out of the memory-mapped file. Each file is
opened per read, so no mapping (and none of its touched pages) outlives the tensor being loaded.
Writing produces the safetensors format directly: the header is known up front (names, dtypes,
shapes), so tensors are appended one at a time and never held together.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from pathlib import Path

import torch
from omegaconf import DictConfig

from ftcore.errors import FtcoreError
from ftcore.hf import fp8, fused_experts, mappings
from ftcore.precision import delayed
from ftcore.runtime import safe_files

log = logging.getLogger("ftcore")
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn}  # fmt: skip
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # bytes: safetensors' own bound on a header (100 MB)


def _header(path: Path, field: str, wanted: str | None = None) -> dict:
    """The JSON header of a safetensors file, checked against the file's size (truncation)."""
    what = f" (holding {wanted})" if wanted else ""
    if not path.is_file():
        raise FtcoreError(f"safetensors shard {path}{what} is missing", field=field,
                          fix="copy the complete model directory (every file the index names)")  # fmt: skip
    size = path.stat().st_size
    try:
        with safe_files.open_read(path, field, root=path.parent) as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER:  # refused before a byte of it is read (safetensors' own limit)
                raise ValueError(f"header of {n} bytes, over safetensors' {MAX_HEADER}-byte limit")
            if n > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
                  default=0)  # fmt: skip
    except (OSError, ValueError, struct.error, RecursionError, AttributeError, KeyError,
            TypeError, IndexError) as e:  # fmt: skip
        raise FtcoreError(f"{path}{what} is not a readable safetensors file ({type(e).__name__}: "
                          f"{str(e)[:200]})", field=field,
                          fix="re-download or re-save the shard") from e  # fmt: skip
    if 8 + n + end > size:
        raise FtcoreError(f"{path}{what} is truncated: {size} bytes, its header needs {8 + n + end}",
                          field=field, fix="re-download or re-save the shard")  # fmt: skip
    return header


class SafetensorsDir:
    """The tensors of a local HF directory: name -> (file, dtype, shape), from the index or headers."""

    def __init__(self, path: str | Path, field: str = "model.hf_path", fp8_block=None):
        """`fp8_block`: the checkpoint's FP8 block (quantization_config.weight_block_size): a
        tensor with a `<name>_scale_inv` beside it is read dequantized (hf/fp8.py)."""
        self.root, self.field, self.fp8_block = Path(path), field, fp8_block
        index = self.root / INDEX
        self.files: dict[str, Path] = {}
        self._headers: dict[Path, dict] = {}
        if index.is_file():
            weight_map = safe_files.read_json_object(index, field, root=self.root).get("weight_map")
            if not isinstance(weight_map, dict):
                raise FtcoreError(f"{index} is not a valid safetensors index (no weight_map)",
                                  field=field, fix="download model.safetensors.index.json again")  # fmt: skip
            # every file it names inside this directory: never an absolute path, `..` or a link out
            self.files = {k: safe_files.inside(self.root, str(v), field, what=str(index))
                          for k, v in weight_map.items()}  # fmt: skip
        else:
            shards = safe_files.entries(self.root, field, "*.safetensors")
            if not shards:
                raise FtcoreError(f"{self.root} holds no *.safetensors files", field=field,
                                  fix="save the model with safe_serialization (the default)")  # fmt: skip
            for p in shards:
                for k in self._header(p):
                    if k != "__metadata__":
                        self.files[k] = p
        self.fused = fused_experts.is_fused(self.files)  # transformers 5's 3D experts on disk

    def _header(self, path: Path, wanted: str | None = None) -> dict:
        if path not in self._headers:
            self._headers[path] = _header(path, self.field, wanted)
        return self._headers[path]

    def entry(self, name: str) -> tuple[Path, dict]:
        if name not in self.files:
            raise FtcoreError(f"tensor {name} is not in {self.root}", field=self.field,
                              fix="is this checkpoint the one its config.json describes?")  # fmt: skip
        path = self.files[name]
        header = self._header(path, name)
        if name not in header:
            raise FtcoreError(
                f"{path} does not hold tensor {name} (the index says it does)",
                field=self.field,
                fix="download the checkpoint's files again (one is incomplete)",
            )
        return path, header[name]

    def check_shape(self, name: str, expected: tuple[int, ...]) -> None:
        path, meta = self.entry(name)
        if tuple(meta["shape"]) != tuple(expected):
            raise FtcoreError(
                f"{path}: tensor {name} has shape {tuple(meta['shape'])}, the config implies {tuple(expected)}",
                field=self.field, fix="config.json and the safetensors files must come from the same model",
            )  # fmt: skip

    def check_all(self, shapes: mappings.Shapes) -> None:
        """Every tensor of the model present with the config's shape, every shard whole (headers
        only). Run on every rank before reading, so all ranks fail alike instead of some waiting."""
        names = mappings.hf_names(shapes)
        if self.fused:
            for name, shape in fused_experts.fused_shapes(names, shapes, mappings.hf_shape).items():
                self.check_shape(name, shape)
            return
        for name in names:
            self.check_shape(name, mappings.hf_shape(name, shapes))

    def read(self, piece: mappings.Piece) -> torch.Tensor:
        """Only the rows/columns of `piece`, copied out of the memory-mapped file; an FP8 weight
        dequantized to fp32 from the scale blocks that cover just those (hf/fp8.py)."""
        scale = piece.hf + fp8.SCALE if piece.hf else None
        if scale in self.files and piece.expert is None:
            return self._dequantized(piece, scale)
        return self._read(piece)

    def _dequantized(self, piece: mappings.Piece, scale: str) -> torch.Tensor:
        if self.fp8_block is None:
            raise FtcoreError(f"{piece.hf} has {scale} but config.json no quantization_config",
                              field=self.field, fix="restore config.json from the model's "
                              "original files")  # fmt: skip
        _, meta = self.entry(piece.hf)
        rows, cols = meta["shape"][0], meta["shape"][1] if len(meta["shape"]) > 1 else 1
        r, c = piece.rows or (0, rows), piece.cols or (0, cols)
        sr, sc = fp8.scale_span(r, c, self.fp8_block)
        q = self._read(mappings.Piece(piece.hf, r, piece.cols))
        s = self._read(mappings.Piece(scale, sr, sc))
        return fp8.dequantize(q, s, self.fp8_block, r[0], c[0])

    def raw(self, piece: mappings.Piece) -> torch.Tensor:
        """The rows/columns of `piece` as stored (an FP8 weight not dequantized)."""
        return self._read(piece)

    def _read(self, piece: mappings.Piece) -> torch.Tensor:
        from safetensors import SafetensorError

        path, _ = self.entry(piece.hf)
        r = slice(*piece.rows) if piece.rows else slice(None)
        try:
            with safe_files.safetensors_open(path, self.field, root=self.root) as f:
                sl = f.get_slice(piece.hf)
                c = slice(*piece.cols) if piece.cols else slice(None)
                if piece.expert is not None:  # one expert of a fused [E, rows, cols] tensor
                    return sl[piece.expert : piece.expert + 1, r, c][0]
                if len(sl.get_shape()) == 1:
                    return sl[r]
                return sl[r, c] if piece.cols else sl[r]
        except (SafetensorError, OSError) as e:
            raise FtcoreError(f"cannot read tensor {piece.hf} from {path}: {e}", field=self.field,
                              fix="re-download or re-save the shard") from e  # fmt: skip


def weights_source(cfg: DictConfig) -> tuple[Path, str]:
    """(directory, config field): model.hf_path, else model.init_path (relative to the assets)."""
    if cfg.model.hf_path:
        return Path(cfg.model.hf_path).expanduser(), "model.hf_path"
    p = Path(cfg.model.init_path).expanduser()
    if not p.exists():
        from ftcore.config.schema import assets_dir

        p = assets_dir() / cfg.model.init_path
    if not p.is_dir():
        raise FtcoreError(f"{cfg.model.init_path} is not a directory (nor one under the bundled assets)",
                          field="model.init_path", fix="a directory holding model.safetensors")  # fmt: skip
    return p, "model.init_path"


READ_BLOCK_BYTES = 16 * 2**20  # rows read per safetensors call: bounds the transient buffer


def _blocks(piece: mappings.Piece, shape: list[int], itemsize: int) -> list[mappings.Piece]:
    """`piece` cut into row blocks of at most READ_BLOCK_BYTES (1-D tensors stay whole)."""
    if piece.expert is not None:  # a fused experts tensor: the expert's own [rows, cols]
        shape = shape[1:]
    if len(shape) < 2:
        return [piece]
    r0, r1 = piece.rows or (0, shape[0])
    width = (piece.cols[1] - piece.cols[0]) if piece.cols else shape[1]
    step = max(1, READ_BLOCK_BYTES // max(1, width * itemsize))
    return [
        mappings.Piece(piece.hf, (a, min(a + step, r1)), piece.cols, piece.expert)
        for a in range(r0, r1, step)
    ]


def _quantized(p: torch.Tensor) -> bool:
    """A tensor subclass (Transformer Engine's FP8/FP4 tensors), not plain memory rows can be
    written into: it gets its shard assembled first and written whole."""
    return type(p) not in (torch.Tensor, torch.nn.Parameter)


@torch.no_grad()
def load_weights(cfg: DictConfig, chunks: list) -> None:
    """Every parameter of this rank's chunks from the HF directory, reading only this rank's slices.

    Each piece is read in row blocks straight into its rows of the parameter, so beyond the shard
    itself a rank holds one block (and its mapped pages) at a time.

    A quantized parameter is never written piece by piece: with `fp8_param_gather` the base weights
    are Transformer Engine Float8Tensors (or MXFP8/NVFP4 tensors). A slice of a Float8Tensor is a
    view that shares its parent's scale_inv and quantizer, and `copy_` of a plain tensor into it
    calls `quantize_`, which under current scaling takes the scale from the amax of that slice
    alone and writes it into the shared scale_inv: rows written earlier would be decoded with the
    last piece's scale, with no error (TE's tensor/float8_tensor.py and quantized_tensor.py). So
    its shard is assembled in high precision (its dtype, on its device) and written with one
    `copy_`, which quantizes with the whole shard's amax: one extra shard at a time. Under delayed
    scaling that `copy_` casts with the quantizer's stored scale (1 before any step) instead: the
    scale is first set from the shard's amax by TE's own update rule (precision/delayed.py).

    QLoRA's base linears go the same way without ever holding full-precision storage: their
    parameter is a meta placeholder whose `take_whole` quantizes the assembled shard to NF4
    (models/nf4.py), so a rank holds the NF4 base and one full-precision shard at a time."""
    from megatron.core import parallel_state as ps

    from ftcore.models.sharding import is_expert, iter_weights, shard_info, tp_of

    root, field = weights_source(cfg)
    st = SafetensorsDir(root, field, cfg.model.get("fp8_block"))
    shapes = mappings.Shapes.from_cfg(cfg.model)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    st.check_all(shapes)
    for name, p in list(iter_weights(chunks)):  # a list: QLoRA's take_whole swaps parameters
        mp = mappings.resolve(name, shapes.tie, shapes)
        if mp is None:
            raise FtcoreError(f"parameter {name} has no Hugging Face counterpart", field=field,
                              fix="load HF weights before adding adapters; only the layers of ftcore/config/families.py are mapped")  # fmt: skip
        n, r = tp_of(name) if is_expert(name) else (tp, tp_rank)  # an expert: only its own
        pieces = mappings.shard_pieces(mp, info=shard_info(name, p, n), s=shapes, tp_rank=r, tp=n)
        if st.fused:
            pieces = [fused_experts.fused_piece(x, shapes.moe_ffn) for x in pieces]
        take = getattr(p, "take_whole", None)  # QLoRA's NF4 linears (models/nf4.py), on meta
        whole = take is not None or _quantized(p)
        device = getattr(p, "whole_device", p.device)
        dst = torch.empty(p.shape, dtype=p.dtype, device=device) if whole else p
        row = _fill_rows(st, name, dst, pieces, field)
        if row != p.shape[0]:
            raise FtcoreError(
                f"{name}: {', '.join(mp.hf)} filled {row} of {p.shape[0]} rows",
                field=field,
                fix="a checkpoint of the model config.json describes (download it again)",
            )
        if take is not None:
            take(dst)  # quantized as read: the full-precision shard is dropped right here
        elif whole:
            delayed.scale_for_load(p, dst, cfg.precision.fp8_margin)  # fp8_delayed: not scale 1
            p.copy_(dst)
        del dst
    log.info("loaded %s weights from %s", field, root)


def _fill_rows(st: SafetensorsDir, name: str, dst: torch.Tensor, pieces, field: str) -> int:
    """The rows of `dst` from `pieces` in order, each read in blocks of at most READ_BLOCK_BYTES (a
    piece without a tensor is zero rows: the padded vocab); returns the number of rows filled."""
    row = 0
    for piece in pieces:
        if piece.hf is None:
            n = piece.rows[1] - piece.rows[0]
            dst[row : row + n].zero_()
            row += n
            continue
        _, meta = st.entry(piece.hf)
        itemsize = torch.empty((), dtype=DTYPES.get(meta["dtype"], torch.float32)).element_size()
        for block in _blocks(piece, meta["shape"], itemsize):
            t = st.read(block)
            rows = dst[row : row + t.shape[0]]  # 1-D too: a TP shard of the q/k/v bias
            if tuple(t.shape) != tuple(rows.shape):
                raise FtcoreError(f"{name}: {block.hf} rows {block.rows} give {tuple(t.shape)}, the "
                                  f"parameter's slice is {tuple(rows.shape)}", field=field,
                                  fix="a checkpoint of the model config.json describes")  # fmt: skip
            rows.copy_(t)
            row += t.shape[0]
            del t
    return row


class StreamWriter:
    """One safetensors file written tensor by tensor: the header first (from the planned names,
    dtypes and shapes), then each tensor's bytes at its planned offset as it arrives."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        self.path, self.entries, self.pending = path, {}, set()
        header, offset = {}, 0
        for name, dtype, shape in entries:
            n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": DTYPE_NAMES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self.entries[name] = (dtype, tuple(shape), offset)
            offset += n
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.tmp = path.with_name(path.name + ".tmp")
        self.f = safe_files.create(self.tmp)
        self.f.write(struct.pack("<Q", len(raw)) + raw)
        self.data_start = 8 + len(raw)
        self.pending = set(self.entries)
        self.f.truncate(self.data_start + offset)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write one planned tensor (any order: each has its own place in the file)."""
        dtype, shape, offset = self.entries[name]
        if tuple(tensor.shape) != shape or name not in self.pending:
            raise RuntimeError(
                f"{self.path}: unexpected {name}{tuple(tensor.shape)} (planned {shape})"
            )
        t = tensor.detach().to("cpu", dtype).contiguous().reshape(-1)
        self.f.seek(self.data_start + offset)
        if t.numel():
            self.f.write(t.view(torch.uint8).numpy().data)
        self.pending.discard(name)

    def close(self) -> None:
        if self.pending:
            raise RuntimeError(f"{self.path}: never written: {', '.join(sorted(self.pending))}")
        self.f.close()
        os.replace(self.tmp, self.path)
