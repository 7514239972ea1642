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
from ftcore.config.checks import check_divisibility
from ftcore.config.schema import compose, conf_dir
from ftcore.errors import FtcoreError

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
    assert cfg.bench.name == name and cfg.bench.kind in ("layouts", "cpu_vs_hf")
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
    out = tmp_path / "bench"
    lines = _run_bench("cpu_vs_hf_smoke", out)
    assert [x["label"] for x in lines] == ["hf_trainer", "packed", "padded"]
    assert all(x["status"] == "ok" for x in lines), [x.get("error") for x in lines]
    hf, packed, padded = lines
    # the same documents on both sides: one epoch each
    assert hf["tokens"] == padded["tokens"] and hf["target_tokens"] == padded["target_tokens"]
    assert packed["tokens"] >= hf["tokens"]
    for x in (packed, padded):
        assert x["ratio_vs_hf"] > 0 and math.isfinite(x["eval_loss"])
        assert x["eval_tokens"] == hf["eval_tokens"]
    assert "| ftcore | packed |" in (out / "bench.md").read_text()
    # the three took turns: each waited for the others, outside its timed epoch
    assert all(x["turns"] == 2 and x["waited_s"] > 0 for x in lines)


def test_cpu_vs_hf_report_takes_medians_over_rounds(tmp_path):
    """With bench.repeats each ftcore run is compared with the HF run of its own round; bench.md
    leads with the median ratio and its range."""

    def line(rnd, side, label, tps, ratio=None):
        return {"bench": "b", "kind": "cpu_vs_hf", "invocation": "i", "command": "c", "time": "t",
                "round": rnd, "side": side, "label": label, "status": "ok", "steps": 1,
                "tokens": 10, "wall_s": 1.0, "tokens_per_s": tps, "ratio_vs_hf": ratio,
                "eval_loss": 5.0, "eval_loss_rel_diff": None if side == "hf" else 0.01}  # fmt: skip

    lines = [
        line(1, "hf", "hf_trainer", 100.0), line(1, "ftcore", "packed", 150.0, 1.5),
        line(2, "hf", "hf_trainer", 80.0), line(2, "ftcore", "packed", 100.0, 1.25),
        line(3, "hf", "hf_trainer", 90.0), line(3, "ftcore", "packed", 117.0, 1.3),
    ]  # fmt: skip
    (s_hf, s_packed) = report.summary(lines)
    assert s_hf["tokens_per_s"] == 90.0 and s_packed["rounds"] == 3
    assert s_packed["ratio"] == 1.3 and s_packed["ratio_range"] == (1.25, 1.5)
    (tmp_path / "bench.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    md, png = report.write(tmp_path)
    text = md.read_text()
    assert "| packed | 3 | 117 | 1.30 | 1.25–1.50 | +1.0% |" in text
    assert "| 2 | ftcore | packed |" in text and png.stat().st_size > 0
