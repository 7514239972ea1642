"""ftcore.bench: run lists, every shipped benchmark composes, the report files, and two tiny
end-to-end benchmarks in fresh processes (a 1-step layout run; ftcore vs the HF Trainer recipe).
Speed is never asserted: only that the lines and files are there and well-formed."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftcore.bench import report
from ftcore.bench.dispatch import _extra, normalise
from ftcore.bench.runner import expand_runs
from ftcore.config.schema import compose, conf_dir
from ftcore.errors import FtcoreError
from ftcore.validation.checks import check_divisibility

PNG = b"\x89PNG\r\n\x1a\n"
BENCHES = sorted(p.stem for p in (conf_dir() / "bench").glob("*.yaml") if p.stem != "none")


def _bench(**kw):
    base = {"name": "t", "runs": [], "sweep": {}}
    return OmegaConf.create({**base, **kw})


def test_runs_lists_dicts_and_sweep():
    b = _bench(
        runs=[["parallel.tp=2"], {"label": "x", "overrides": ["parallel.pp=2"], "env": {"A": 1}}],
        sweep={"parallel.recompute": ["none", "full"], "data.packing": [True, False]},
    )
    runs = expand_runs(b)
    assert [r.label for r in runs[:2]] == ["tp=2", "x"]
    assert runs[1].env == {"A": "1"}
    assert len(runs) == 6
    assert runs[2].overrides == ["parallel.recompute=none", "data.packing=true"]


def test_held_out_marks_a_run_the_planner_was_not_fitted_to():
    runs = expand_runs(_bench(runs=[{"label": "a", "overrides": [], "held_out": True},
                                    {"label": "b", "overrides": [], "held_out": False}, ["x=1"]]))  # fmt: skip
    assert [r.held_out for r in runs] == [True, False, None]
    with pytest.raises(FtcoreError, match="held_out") as e:
        expand_runs(_bench(runs=[{"label": "a", "overrides": [], "held_out": "yes"}]))
    assert e.value.field == "bench.runs.held_out"
    # the shipped layouts_cpu marks the nine runs local_cpu was fitted to; the holdout bench none
    fitted = [r.held_out for r in expand_runs(compose(["bench=layouts_cpu"]).bench)]
    assert fitted.count(False) == 9 and None not in fitted
    holdout = expand_runs(compose(["bench=layouts_cpu_holdout"]).bench)
    assert holdout and all(r.held_out is True for r in holdout)


def test_duplicate_labels_and_empty_bench_are_user_errors():
    with pytest.raises(FtcoreError, match="duplicate"):
        expand_runs(_bench(runs=[["parallel.tp=2"], ["parallel.tp=2"]]))
    with pytest.raises(FtcoreError, match="no runs"):
        expand_runs(_bench())


def test_plus_bench_selects_the_group_and_other_overrides_go_to_every_run():
    argv = ["+bench=layouts_cpu", "bench.measure_steps=3", "cluster.num_gpus=16"]
    assert normalise(argv)[0] == "bench=layouts_cpu"
    assert _extra(argv) == ["cluster.num_gpus=16"]


@pytest.mark.parametrize("name", BENCHES)
def test_every_shipped_bench_composes(name):
    cfg = compose([f"bench={name}"])
    kinds = ("layouts", "cpu_vs_hf", "host_overhead", "plan_search")
    assert cfg.bench.name == name and cfg.bench.kind in kinds
    if cfg.bench.kind == "host_overhead":  # no run list: its runs are depths x sides
        return  # composed in tests/unit/bench/test_overhead.py
    if cfg.bench.kind == "plan_search":  # each run an experiment, searched: any layout is free
        exps = {p.stem for p in (conf_dir() / "exp").glob("*.yaml")}
        named = {o.split("=", 1)[1] for r in expand_runs(cfg.bench) for o in r.overrides
                 if o.startswith("+exp=")}  # fmt: skip
        assert named == exps, named ^ exps  # every shipped experiment, and only those
        return
    for run in expand_runs(cfg.bench):
        run_cfg = compose([*cfg.bench.base, *run.overrides])
        check_divisibility(run_cfg)


def _layout_line(label, **kw):
    lay = {"tp": 2, "pp": 1, "vp": 1, "cp": 1, "dp": 1, "sp": True, "distributed_optimizer": False,
           "recompute": "none", "packing": True, "peft": "none"}  # fmt: skip
    line = {
        "bench": "t", "kind": "layouts", "invocation": "inv2", "command": "python -m ftcore.bench",
        "time": "now", "machine": {"host": "h", "cpu": "c", "cores": 2}, "label": label,
        "status": "ok", "layout": lay, "tokens_per_s_per_gpu": 100.0,
        "slot_tokens_per_s_per_gpu": 120.0, "predicted": {"tokens_per_s_per_gpu": 110.0},
        "measured_over_predicted": 1.09, "step_time_s": 0.5, "step_time_spread": 0.1,
        "model_tflops_per_gpu": 0.01, "mfu": 0.1, "peak_mem_gib": 1.0, "load_avg": [[1.0], [2.0]],
        "time_split_s": dict.fromkeys(report.SPLIT, 0.1),
    }  # fmt: skip
    return {**line, **kw}


def test_report_is_the_latest_invocation(tmp_path):
    lines = [
        _layout_line("old", invocation="inv1"),
        _layout_line("a"),
        _layout_line("b", status="failed", error="exit 1: boom"),
    ]
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + "{torn")
    md, png = report.write(tmp_path)
    text = md.read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert [r.split("|")[1].strip() for r in rows] == ["run", "a", "b"]
    assert "tp2 pp1 dp1 sp packed" in text and "failed: exit 1: boom" in text
    assert "load average 1.0–2.0" in text
    assert png.read_bytes().startswith(PNG)


def test_report_labels_fitted_and_held_out_runs(tmp_path):
    lines = [_layout_line("fit", held_out=False, measured_over_predicted=1.1),
             _layout_line("new1", held_out=True, measured_over_predicted=0.8),
             _layout_line("new2", held_out=True, measured_over_predicted=1.3),
             _layout_line("plain")]  # fmt: skip
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = report.write(tmp_path)[0].read_text()
    rows = {r.split("|")[1].strip(): r.split("|")[2].strip() for r in text.splitlines()
            if r.startswith("| ") and "---" not in r}  # fmt: skip
    assert rows == {"run": "planner fit", "fit": "fitted", "new1": "held out",
                    "new2": "held out", "plain": "–"}  # fmt: skip
    assert "- fitted runs (1): meas/pred median 1.10, range 1.10–1.10" in text
    assert "- held out runs (2): meas/pred median 1.05, range 0.80–1.30" in text


def _run_bench(name: str, out: Path, *extra: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "ftcore.bench", f"+bench={name}", f"bench.output_dir={out}", *extra],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "bench.jsonl").read_text().splitlines()]
    assert (out / "bench.png").read_bytes().startswith(PNG)
    return lines


def test_tiny_layout_bench_end_to_end(tmp_path):
    out = tmp_path / "bench"
    (line,) = _run_bench("tiny_smoke", out)
    assert line["status"] == "ok", line.get("error")
    assert line["steps_measured"] == 1 and line["layout"]["world"] == 1
    assert line["step_time_s"] > 0 and line["tokens_per_s_per_gpu"] > 0
    split = line["time_split_s"]
    assert set(split) == set(report.SPLIT)
    # timed through state.timers: every part a one-process step has, and no pipeline
    assert all(split[k] > 0 for k in ("data", "fwd_bwd", "grad_sync", "optimizer")), split
    assert split["pp_p2p"] == 0.0
    assert line["predicted"]["tokens_per_s_per_gpu"] > 0
    assert math.isfinite(line["measured_over_predicted"])
    assert len(line["losses"]) == 2 and all(math.isfinite(x) for x in line["losses"])
    md = (out / "bench.md").read_text()
    assert "| single | tp1 pp1 dp1 packed |" in md and line["command"] in md
    # the versions the numbers came from, as the packages themselves report them
    import torch
    import transformers

    packages = line["machine"]["packages"]
    assert packages["torch"] == torch.__version__
    assert packages["transformers"] == transformers.__version__
    assert f"transformers {transformers.__version__}" in md
    # the host's one-thread rates that the local_cpu prediction used
    assert line["machine"]["probe"]["fp32"] > 0 and "One thread: fp32 matmul" in md
    # and measured again just before the run, for its prediction
    assert line["host_probe"]["fp32"] > 0 and "| host fp32 GFLOP/s |" in md


def test_cpu_vs_hf_end_to_end(tmp_path):
    """Both pairs of the smoke benchmark on one of its depths (the pairing over depths is
    test_pairs'): every side ran, each pair trained on the same documents in the same steps and is
    comparable, each side has its efficiency against the GEMM rate measured in the round, and the
    report and its published copy (md, png, raw JSONL) are written."""
    out = tmp_path / "bench"
    lines = _run_bench(
        "cpu_vs_hf_smoke", out, "bench.models=[{label:1L,shape:{num_hidden_layers:1}}]"
    )
    assert [x["label"] for x in lines] == [
        "hf-flattened",
        "ftcore-packed",
        "hf-padded",
        "ftcore-padded",
    ]
    assert all(x["status"] == "ok" for x in lines), [x.get("error") for x in lines]
    assert lines[0]["optim"] == "adamw_torch_fused" and lines[0]["attn_implementation"] == "sdpa"
    for hf, ft in (lines[:2], lines[2:]):
        for k in ("steps", "measured_steps", "groups_digest", "tokens", "target_tokens",
                  "epoch_tokens", "epoch_target_tokens", "flops_per_token", "gemm_flops_per_s"):  # fmt: skip
            assert hf[k] == ft[k], k
        assert ft["comparable"] is True and ft["reason"] is None, ft["reason"]
        assert hf["measured_steps"] == hf["steps"] - 2 and 0 < hf["tokens"] < hf["epoch_tokens"]
        assert ft["eval_tokens"] == hf["eval_tokens"] and ft["ratio_vs_hf"] > 0
        for x in (hf, ft):
            assert 0 < x["efficiency"] and x["model_flops_per_s"] > 0 and x["wall_s"] > 0
            assert x["turns"] == 2 and x["waited_s"] > 0  # took turns, the waits left out
            assert math.isfinite(x["train_loss"]) and math.isfinite(x["eval_loss"])
    # the packed pair: several documents per step on both sides, HF in one flattened row
    assert lines[1]["layout"]["packing"] and lines[0]["steps"] > lines[2]["steps"]
    md = (out / "bench.md").read_text()
    assert "| 1L | ftcore-packed vs hf-flattened | 1/1 |" in md
    assert "| 1L | ftcore-padded vs hf-padded | 1/1 |" in md and "What this says about GPUs" in md
    docs = report.publish(out, tmp_path / "docs", "testhw")
    assert [p.suffix for p in docs] == [".md", ".png", ".jsonl"]
    raw = [json.loads(x) for x in docs[2].read_text().splitlines()]
    assert raw == lines and all(
        x["command"] and x["commit"] and x["machine"]["packages"] for x in raw
    )
    assert f"({docs[1].name})" in docs[0].read_text()


def test_cpu_vs_hf_report_leaves_refused_pairs_out_of_the_medians(tmp_path):
    """bench.md's headline: medians over comparable rounds only; a refused round is listed with
    its reason, and every round stays in the per-round table."""

    def line(rnd, side, label, **kw):
        return {"bench": "b", "kind": "cpu_vs_hf", "invocation": "20261126-010203", "command": "c",
                "time": "t", "round": rnd, "model": "4L", "pair": "packed", "side": side,
                "label": label, "status": "ok", "steps": 12, "measured_steps": 2, "tokens": 1024,
                "target_tokens": 139, "wall_s": 1.0, "cpu_s": 1.0, "tokens_per_s": 1024.0,
                "eval_loss": 6.0, "train_loss": 7.0, "model_flops_per_s": 2e9, "efficiency": 0.1,
                "gemm_flops_per_s": 2e10, "gemm": {"size": 2048, "threads": 2}, "warmup_steps": 10,
                "loss_tolerance": 0.02, **kw}  # fmt: skip

    lines = [
        line(1, "hf", "hf-flattened"),
        line(1, "ftcore", "ftcore-packed", ratio_vs_hf=1.6, ratio_vs_hf_cpu=1.5, comparable=True),
        line(2, "hf", "hf-flattened"),
        line(2, "ftcore", "ftcore-packed", ratio_vs_hf=3.0, comparable=False,
             reason="eval loss 6.5000 vs HF 6.0000 (+8.3%, over bench.loss_tolerance 0.02)"),
    ]  # fmt: skip
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    md, png = report.write(tmp_path)
    text = md.read_text()
    assert "| 4L | ftcore-packed vs hf-flattened | 1/2 | **1.60** | 1.60–1.60 | 1.50 |" in text
    assert "- 4L ftcore-packed vs hf-flattened, round 2: eval loss 6.5000 vs HF 6.0000" in text
    assert "| 2 | 4L | ftcore | ftcore-packed | 12 (2) |" in text and "| no: eval loss" in text
    assert "from the end of optimizer step 10" in text and "2048² fp32 on 2 threads: 20" in text
    assert png.read_bytes().startswith(PNG)
    assert report.published_stem(lines, "xeon2core") == "b_xeon2core_2026-11-26"


def test_a_second_invocation_on_the_same_day_gets_its_own_report(tmp_path):
    """publish names reports <bench>_<hw>_<date>; another invocation that day must not overwrite
    the first (a dated record), the same invocation published again keeps its name."""
    stem = "host_overhead_hw_2026-11-26"
    assert report.free_stem(tmp_path, stem, "20261126-022221") == stem
    (tmp_path / f"{stem}.jsonl").write_text(json.dumps({"invocation": "20261126-022221"}) + "\n")
    assert report.free_stem(tmp_path, stem, "20261126-022221") == stem
    assert report.free_stem(tmp_path, stem, "20261126-091500") == f"{stem}-2"
