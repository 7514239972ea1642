"""QLoRA's base linears hold no full-precision storage before their weights are read: with a weights
source they are built as NF4 placeholders (a meta `weight`), and the loader quantizes each shard as
it assembles it (hf/io.py), leaving only the packed NF4 data."""

from __future__ import annotations

import pytest
import torch

from ftcore.config.schema import compose
from tests.support.tiny import TINY
from tests.unit.models.test_builder import runtime  # noqa: F401 - the one-rank fixture

QLORA = [*TINY, "peft=qlora"]
LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _linears(chunks):
    for chunk in chunks:
        for layer in chunk.decoder.layers:
            for parent in (layer.self_attention, layer.mlp):
                for name in LINEARS:
                    if hasattr(parent, name):
                        yield getattr(parent, name)


def test_loaded_qlora_base_is_built_without_storage_and_quantized_as_read(runtime, tmp_path):  # noqa: F811
    from ftcore.hf.config import merge_hf_config
    from ftcore.hf.io import load_weights
    from ftcore.models.builder import build_model
    from ftcore.models.nf4 import NF4ParallelLinear
    from tests.support.hf_helpers import compose_hf, make_tiny_hf

    hf = make_tiny_hf(tmp_path / "hf")  # a weights source: the base is read, not drawn
    cfg = merge_hf_config(compose_hf(str(hf), str(tmp_path / "run"), ["peft=qlora"]))
    chunks = build_model(cfg)
    linears = list(_linears(chunks))
    assert len(linears) == 4 * cfg.model.num_layers
    for m in linears:
        assert isinstance(m, NF4ParallelLinear), type(m).__name__
        assert [n for n, p in m.named_parameters() if not p.is_meta] == []  # nothing allocated
    load_weights(cfg, chunks)
    for m in linears:
        names = [n for n, _ in m.named_parameters()]
        assert names == ["qweight"] and m.qweight.dtype == torch.uint8
        assert m.qweight.numel() * 2 == m.shape[0] * m.shape[1]  # 4 bits per weight
    x = torch.randn(3, 1, linears[0].shape[1])
    assert torch.isfinite(linears[0](x)[0]).all()


def test_random_qlora_base_keeps_megatrons_linears_until_apply_peft(runtime):  # noqa: F811
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from ftcore.models.builder import build_model

    chunks = build_model(compose([*QLORA, "model.init_path=null"]))
    assert all(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) for m in _linears(chunks))


def test_a_dry_build_on_meta_leaves_later_quantisation_working(monkeypatch):
    """A dry build quantises on the meta device first (ftcore.plan plan.dry_build=true); a real
    quantisation afterwards in the same process still works and round-trips."""
    import bitsandbytes.functional as bnbf

    from ftcore.models.nf4 import NF4ParallelLinear

    monkeypatch.delitem(bnbf.name2qmap, "dynamic", raising=False)  # as in a fresh process
    meta = NF4ParallelLinear(
        (64, 128), torch.float32, "meta", column=True, sp=False, double_quant=True
    )
    meta.quantize_(torch.empty(64, 128, device="meta"))
    real = NF4ParallelLinear(
        (64, 128), torch.float32, "cpu", column=True, sp=False, double_quant=True
    )
    w = torch.randn(64, 128)
    real.quantize_(w)
    assert (real.weight_fp() - w).abs().max() < 0.25 * w.abs().max()  # NF4's error, not garbage


def test_a_row_shard_quantises_in_the_one_process_blocks():
    """The tiny base's down_proj at TP=2: 352 columns a shard, 5.5 NF4 blocks. Quantising the
    shard alone puts other values in its blocks than one process does (the bug); the slab of whole
    blocks around it (`block_window`), sliced after dequantising, gives every value bit for bit."""
    import bitsandbytes.functional as bnbf

    from ftcore.models.nf4 import BLOCKSIZE, block_window

    def nf4(w):
        packed, state = bnbf.quantize_4bit(w.contiguous(), blocksize=BLOCKSIZE, quant_type="nf4")
        return bnbf.dequantize_4bit(packed, state).view(w.shape)

    g = torch.Generator().manual_seed(0)
    full = torch.randn(256, 704, generator=g) * torch.linspace(0.1, 3.0, 704)  # blocks differ
    whole = nf4(full)
    assert block_window(704 // 2, 2, 0) == (0, 384) and block_window(704 // 2, 2, 1) == (320, 704)
    assert block_window(128, 2, 1) is None  # a shard of whole blocks is quantised as it is
    alone = nf4(full[:, 352:])
    assert not torch.equal(alone, whole[:, 352:])
    for rank in range(2):
        a, b = block_window(352, 2, rank)
        c0 = rank * 352
        got = nf4(full[:, a:b])[:, c0 - a : c0 - a + 352]
        assert torch.equal(got, whole[:, c0 : c0 + 352]), rank


def test_qlora_at_tp2_refuses_an_input_width_of_partial_blocks():
    from ftcore.errors import FtcoreError
    from ftcore.peft.config import check_config

    ok = compose([*QLORA, "model.ffn_hidden_size=704", "parallel.tp=2"])
    check_config(ok)
    bad = compose([*QLORA, "model.ffn_hidden_size=704", "model.hidden_size=96", "parallel.tp=2"])
    with pytest.raises(FtcoreError) as e:
        check_config(bad)
    assert e.value.field == "parallel.tp" and "is 96" in str(e.value), str(e.value)
    assert "parallel.tp=1" in str(e.value)
    check_config(compose([*QLORA, "model.hidden_size=96"]))  # one process: one layout, no shards
