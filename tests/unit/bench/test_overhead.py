"""bench/host_overhead: its configuration composes, the per-layer fit, and the HF side's steps (a
tiny PEFT model trained in-process: the adapters move, the frozen base does not)."""

from __future__ import annotations

import pytest

from ftcore.bench.overhead import overhead_md, per_layer
from ftcore.config.schema import compose
from ftcore.validation.checks import check_divisibility


def test_host_overhead_composes():
    cfg = compose(["bench=host_overhead"])
    o = cfg.bench.overhead
    assert cfg.bench.kind == "host_overhead" and len(o.depths) == 2
    run = compose([*cfg.bench.base, f"data.seq_len={o.seq_len}",
                   f"train.global_batch_size={o.rows}", f"train.micro_batch_size={o.rows}"])  # fmt: skip
    check_divisibility(run)
    assert run.peft.name == "lora" and run.data.packing


def _line(side, layers, rnd, cpu_ms):
    return {"side": side, "layers": layers, "round": rnd, "status": "ok", "cpu_ms": cpu_ms,
            "wall_ms": cpu_ms, "label": f"{side}-{layers}L", "rows": 1, "seq_len": 32, "threads": 1}  # fmt: skip


def test_per_layer_is_the_slope_over_depth_median_over_rounds():
    lines = [_line("ftcore", 2, 1, 14.0), _line("ftcore", 10, 1, 54.0),  # 5 ms/layer, rest 4
             _line("ftcore", 2, 2, 16.0), _line("ftcore", 10, 2, 64.0),  # 6 ms/layer, rest 4
             _line("ftcore", 2, 3, 12.0), _line("ftcore", 10, 3, 68.0),  # 7 ms/layer, rest -2
             _line("hf", 2, 1, 20.0), _line("hf", 10, 1, 100.0)]  # fmt: skip
    fit = per_layer(lines)
    assert fit["ftcore"]["per_layer_ms"] == pytest.approx(6.0)
    assert fit["ftcore"]["range"] == pytest.approx([5.0, 7.0])
    assert fit["ftcore"]["rest_ms"] == pytest.approx(4.0)
    assert fit["hf"]["per_layer_ms"] == pytest.approx(10.0) and fit["hf"]["rounds"] == 1
    md = "\n".join(overhead_md(lines))
    assert "| ftcore | 6.000 | 5.000–7.000 | 4.0 | 3 |" in md


def test_hf_side_trains_the_adapters_only(tmp_path):
    from ftcore.bench.hf_recipe import make_hf_model
    from ftcore.bench.hf_steps import run_steps

    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    model_dir = make_hf_model(tmp_path / "m", shape)
    spec = {"model_dir": str(model_dir), "rows": 1, "seq_len": 16, "warmup": 1, "measure": 2,
            "threads": 1, "lora": {"r": 4, "alpha": 8, "targets": ["q_proj", "down_proj"]}}  # fmt: skip
    res = run_steps(spec)
    assert [s["warmup"] for s in res["steps"]] == [True, False, False]
    assert all(s["cpu_s"] > 0 and s["step_time_s"] > 0 for s in res["steps"])
    assert res["trainable"] > 0 and res["adapters_moved"] and not res["base_moved"]
