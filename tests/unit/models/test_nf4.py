"""QLoRA's base linears hold no full-precision storage before their weights are read: with a weights
source they are built as NF4 placeholders (a meta `weight`), and the loader quantizes each shard as
it assembles it (hf/io.py), leaving only the packed NF4 data."""

from __future__ import annotations

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
