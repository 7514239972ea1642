"""LoRA config, target planning, the fused layouts of slice adapters, PEFT key mapping and merge
algebra, and the bad-input contract (exit 2). No model is built here (tests/dist does that)."""

from __future__ import annotations

import json

import pytest
import torch

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.hf import mappings
from ftcore.models.sharding import ShardInfo, take_shard
from ftcore.peft.export import check_adapter_fits, megatron_deltas, save_adapter, to_peft
from ftcore.peft.layers import Geometry, add_column, fuse_column, scaling
from ftcore.peft.lora import LoraSettings, check_config, plan_targets, settings
from tests.support.tiny import TINY

GEO = Geometry(hidden=8, ffn=12, heads=4, groups=2, head_dim=2)
SHAPES = mappings.Shapes(
    hidden=8, ffn=12, heads=4, groups=2, head_dim=2, vocab=16, layers=1, tie=False
)
ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_plan_hf_names_get_one_adapter_per_slice():
    plan = plan_targets(["q_proj", "v_proj", "down_proj"])
    assert plan == {
        "linear_qkv": {"q_proj": "q_proj", "v_proj": "v_proj"},
        "linear_fc2": {"down_proj": "down_proj"},
    }


def test_plan_megatron_names_share_A():
    plan = plan_targets(["linear_qkv", "linear_fc1", "linear_proj"])
    assert plan["linear_qkv"] == {
        "q_proj": "linear_qkv",
        "k_proj": "linear_qkv",
        "v_proj": "linear_qkv",
    }
    assert plan["linear_fc1"] == {"gate_proj": "linear_fc1", "up_proj": "linear_fc1"}
    assert plan["linear_proj"] == {"o_proj": "o_proj"}


@pytest.mark.parametrize("targets", [["q_proj", "foo"], ["linear_qkv", "q_proj"], ["lm_head"]])
def test_plan_refuses_unknown_or_overlapping(targets):
    with pytest.raises(FtcoreError) as e:
        plan_targets(targets)
    assert e.value.field == "peft.target_modules"


def test_rslora_scaling():
    assert scaling(16, 32, False) == 2.0
    assert scaling(16, 32, True) == 8.0


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_qkv_layout_matches_hf_mapping(tp):
    """Per-slice deltas put into the fused layout on each TP rank == the HF->megatron qkv mapping
    of those deltas, sharded the way megatron shards linear_qkv."""
    d = {s: torch.randn(GEO.out_in(s)[0], 8) for s in ("q_proj", "k_proj", "v_proj")}
    mp = mappings.resolve("decoder.layers.0.self_attention.linear_qkv.weight", False)
    full = mappings.from_hf(mp, {h: d[h.split(".")[-2]] for h in mp.hf}, SHAPES, 16)
    info = ShardInfo("x", tuple(full.shape), 0, False)
    for rank in range(tp):
        local = {
            s: t.chunk(tp, 0)[rank].t() for s, t in d.items()
        }  # [in, out/tp]: last dim = output
        got = fuse_column("linear_qkv", local, GEO, tp).t()
        assert torch.equal(got, take_shard(full, info, rank, tp))


@pytest.mark.parametrize("tp", [1, 2])
def test_fused_fc1_layout_matches_hf_mapping(tp):
    d = {s: torch.randn(12, 8) for s in ("gate_proj", "up_proj")}
    mp = mappings.resolve("decoder.layers.0.mlp.linear_fc1.weight", False)
    full = mappings.from_hf(mp, {h: d[h.split(".")[-2]] for h in mp.hf}, SHAPES, 16)
    info = ShardInfo("decoder.layers.0.mlp.linear_fc1.weight", tuple(full.shape), 0, True)
    for rank in range(tp):
        local = {s: t.chunk(tp, 0)[rank].t() for s, t in d.items()}
        got = fuse_column("linear_fc1", local, GEO, tp).t()
        assert torch.equal(got, take_shard(full, info, rank, tp))


def test_missing_slices_are_zero():
    got = fuse_column(
        "linear_qkv", {"v_proj": torch.ones(3, 4)}, GEO, 1
    )  # [.., 2 groups x (4+2+2)]
    assert got.shape == (3, 16)
    assert got.view(3, 2, 8)[..., 6:].eq(1).all() and got.view(3, 2, 8)[..., :6].eq(0).all()


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "module, slices",
    [
        ("linear_qkv", ("q_proj", "k_proj", "v_proj")),
        ("linear_qkv", ("k_proj",)),
        ("linear_fc1", ("gate_proj", "up_proj")),
        ("linear_fc1", ("up_proj",)),
    ],
)
def test_add_column_equals_adding_the_fused_deltas(module, slices, tp):
    """The in-place path LoraParallelLinear takes == base + fuse_column(deltas): output and the
    gradients reaching the base output and every delta (float64, exact up to addition order)."""
    width = {"linear_qkv": 16, "linear_fc1": 24}[module] // tp
    cols = {s: GEO.out_in(s)[0] // tp for s in slices}
    base = torch.randn(3, 2, width, dtype=torch.float64, requires_grad=True)
    deltas = {
        s: torch.randn(3, 2, n, dtype=torch.float64, requires_grad=True) for s, n in cols.items()
    }
    grad = torch.randn(3, 2, width, dtype=torch.float64)

    want = base + fuse_column(module, deltas, GEO, tp)
    want_grads = torch.autograd.grad(want, [base, *deltas.values()], grad)
    got = add_column(base * 1.0, module, deltas, GEO, tp)  # a fresh tensor, as the base returns
    got_grads = torch.autograd.grad(got, [base, *deltas.values()], grad)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def _full_adapters(shared: bool, r: int = 2) -> dict[str, torch.Tensor]:
    pre = "decoder.layers.0."
    out = {}
    if shared:
        out[pre + "self_attention.linear_qkv.lora_A.linear_qkv"] = torch.randn(r, 8)
    for s in ("q_proj", "k_proj", "v_proj"):
        if not shared:
            out[pre + f"self_attention.linear_qkv.lora_A.{s}"] = torch.randn(r, 8)
        out[pre + f"self_attention.linear_qkv.lora_B.{s}"] = torch.randn(GEO.out_in(s)[0], r)
    out[pre + "mlp.linear_fc2.lora_A.down_proj"] = torch.randn(r, 12)
    out[pre + "mlp.linear_fc2.lora_B.down_proj"] = torch.randn(8, r)
    return out


@pytest.mark.parametrize("shared", [False, True])
def test_peft_keys_and_shared_A_copied(shared):
    full = _full_adapters(shared)
    sd, targets = to_peft(full)
    assert targets == ["q_proj", "k_proj", "v_proj", "down_proj"]
    key = "base_model.model.model.layers.0.self_attn.{}.lora_{}.weight"
    assert set(sd) == {key.format(s, ab) for s in ("q_proj", "k_proj", "v_proj") for ab in "AB"} | {
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
        "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
    }
    if shared:
        a = full["decoder.layers.0.self_attention.linear_qkv.lora_A.linear_qkv"]
        assert all(torch.equal(sd[key.format(s, "A")], a) for s in ("q_proj", "k_proj", "v_proj"))


@pytest.mark.parametrize("shared", [False, True])
def test_megatron_merge_equals_hf_merge(shared):
    """scale*B@A folded into the fused megatron tensor, mapped back to HF, is scale*B@A per module."""
    full, scale = _full_adapters(shared), 1.5
    deltas = megatron_deltas(full, GEO, scale)
    sd, _ = to_peft(full)
    mp = mappings.resolve("decoder.layers.0.self_attention.linear_qkv.weight", False)
    hf = mappings.to_hf(mp, deltas["decoder.layers.0.self_attention.linear_qkv.weight"], SHAPES)
    for name, t in hf.items():
        s = name.split(".")[-2]
        a, b = (sd[f"base_model.model.model.layers.0.self_attn.{s}.lora_{x}.weight"] for x in "AB")
        torch.testing.assert_close(t, scale * b @ a)


def _adapter_dir(tmp_path, targets, r=4, hidden=64, layers=4):
    g = Geometry(hidden, 128, 4, 2, hidden // 4)
    sd = {}
    for i in range(layers):
        for s in targets:
            o, n = g.out_in(s)
            parent = "self_attn" if s in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            sd[f"base_model.model.model.layers.{i}.{parent}.{s}.lora_A.weight"] = torch.zeros(r, n)
            sd[f"base_model.model.model.layers.{i}.{parent}.{s}.lora_B.weight"] = torch.zeros(o, r)
    save_adapter(
        tmp_path / "ad", sd, LoraSettings(r, 8.0, 0.0, tuple(targets), False), list(targets), None
    )
    return tmp_path / "ad"


def test_adapter_config_fixes_settings(tmp_path):
    ad = _adapter_dir(tmp_path, ["q_proj", "v_proj"], r=4)
    cfg = compose(TINY + ["peft=lora", "peft.r=16", f"peft.adapter_path={ad}"])
    s = settings(cfg)
    assert (s.r, s.alpha, s.targets) == (4, 8.0, ("q_proj", "v_proj"))
    assert json.loads((ad / "adapter_config.json").read_text())["peft_type"] == "LORA"
    check_config(cfg)


def test_adapter_of_another_base_is_refused(tmp_path):
    cfg = compose(TINY + ["peft=lora"])
    with pytest.raises(FtcoreError) as e:
        check_adapter_fits(_adapter_dir(tmp_path, ["q_proj"], hidden=128), cfg.model)
    assert "another base" in str(e.value)
    with pytest.raises(FtcoreError):
        check_adapter_fits(_adapter_dir(tmp_path, ["q_proj"], layers=6), cfg.model)


def _exit(argv) -> int:
    from ftcore.cli import main
    from ftcore.train import task

    return main("train", task, TINY + argv)


@pytest.mark.parametrize(
    "argv",
    [
        ["peft=lora", "peft.target_modules=[q_proj,attn_out]"],
        ["peft=lora", "peft.r=0"],
        ["peft=lora", "peft.r=-4"],
        ["peft=qlora", "precision=fp8_delayed"],
        ["peft=qlora", "precision=nvfp4"],
    ],
    ids=["unknown_target", "rank0", "rank_negative", "qlora_fp8", "qlora_fp4"],
)
def test_bad_input_exits_2(argv, capsys):
    assert _exit(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err


def test_mismatched_adapter_exits_2(tmp_path, capsys):
    ad = _adapter_dir(tmp_path, ["q_proj"], hidden=128)
    assert _exit(["peft=lora", f"peft.adapter_path={ad}"]) == 2
    assert "another base" in capsys.readouterr().err
