"""bench.md (a table) and bench.png (throughput per configuration) from the latest invocation in
bench.jsonl; older invocations stay in the JSONL for history."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ftcore.bench.overhead import overhead_md
from ftcore.bench.report_vs_hf import cpu_vs_hf_md, plot_vs_hf
from ftcore.errors import FtcoreError

FIT = {True: "held out", False: "fitted"}
SPLIT = ("data", "fwd_bwd", "grad_sync", "pp_p2p", "optimizer", "other")


def read_lines(path: Path) -> list[dict]:
    out = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn line from an interrupted run
    return out


def latest(lines: list[dict]) -> list[dict]:
    if not lines:
        return []
    inv = lines[-1].get("invocation")
    return [ln for ln in lines if ln.get("invocation") == inv]


def _f(x, fmt: str = ".0f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, fmt)


def _layout(lay: dict) -> str:
    parts = [f"tp{lay['tp']}", f"pp{lay['pp']}"]
    if lay["vp"] > 1:
        parts.append(f"vp{lay['vp']}")
    parts.append(f"dp{lay['dp']}")
    if lay.get("cp", 1) > 1:
        parts.append(f"cp{lay['cp']}")
    if lay["sp"]:
        parts.append("sp")
    if lay["distributed_optimizer"]:
        parts.append("dist-opt")
    if lay["recompute"] != "none":
        parts.append(f"rc-{lay['recompute']}")
    parts.append("packed" if lay["packing"] else "padded")
    if lay["peft"] != "none":
        parts.append(lay["peft"])
    return " ".join(parts)


def _header(lines: list[dict]) -> list[str]:
    first = lines[0]
    m = first.get("machine", {})
    loads = [ln["load_avg"] for ln in lines if ln.get("load_avg")]
    load_txt = ""
    if loads:
        lo = min(x[0][0] for x in loads if x and x[0])
        hi = max(x[-1][0] for x in loads if x and x[-1])
        load_txt = f"; 1-min load average {lo:.1f}–{hi:.1f} during the runs"
    where = f"{m.get('host')}: {m.get('cpu')}, {m.get('cores')} cores" + (
        f", {m['gpu']}" if m.get("gpu") else ""
    )
    head = [
        f"# bench {first['bench']} ({first['invocation']})",
        "",
        f"`{first['command']}` at commit {first.get('commit')}, {first['time']}",
        f"on {where}{load_txt}.",
    ]
    if m.get("probe"):
        r = m["probe"]
        head.append(
            f"One thread: fp32 matmul {r['fp32'] * 1e3:.0f} GFLOP/s, bf16 {r['bf16'] * 1e3:.0f} "
            f"GFLOP/s, add {r['gbps']:.1f} GB/s (the planner's local_cpu rates, host_probe)."
        )
    if m.get("packages"):
        head.append("Packages: " + ", ".join(f"{k} {v}" for k, v in m["packages"].items()) + ".")
    return [*head, ""]


def layouts_md(lines: list[dict]) -> list[str]:
    marked = any("held_out" in ln for ln in lines)  # a planner fit column where the bench says

    def fit(ln: dict) -> str:
        return f" {FIT.get(ln.get('held_out'), '–')} |" if marked else ""

    out = [
        f"| run |{' planner fit |' if marked else ''} layout | tokens/s/GPU | slot tok/s/GPU "
        "| predicted | host fp32 GFLOP/s | meas/pred "
        "| step s (median, spread) "
        "| CPU s/step | meas/pred (CPU s) | TFLOP/s/GPU | MFU | peak GiB | split s/step: "
        + " / ".join(SPLIT)
        + " |",
        "|---|"
        + ("---|" if marked else "")
        + "---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for ln in lines:
        if ln.get("status") != "ok":
            out.append(f"| {ln['label']} |{fit(ln)} failed: {ln.get('error', '')[:120]} ||||||||||")
            continue
        pred = ln.get("predicted") or {}
        split = ln.get("time_split_s", {})
        out.append(
            f"| {ln['label']} |{fit(ln)} {_layout(ln['layout'])} "
            f"| {_f(ln['tokens_per_s_per_gpu'])} "
            f"| {_f(ln['slot_tokens_per_s_per_gpu'])} | {_f(pred.get('tokens_per_s_per_gpu'))} "
            f"| {_f((ln.get('host_probe') or {}).get('fp32', math.nan) * 1e3)} "
            f"| {_f(ln.get('measured_over_predicted'), '.2f')} "
            f"| {_f(ln['step_time_s'], '.3f')} ±{_f(100 * ln['step_time_spread'], '.0f')}% "
            f"| {_f(ln.get('cpu_step_s'), '.3f')} | {_f(ln.get('measured_over_predicted_cpu'), '.2f')} "
            f"| {_f(ln['model_tflops_per_gpu'], '.4f')} | {_f(ln.get('mfu') and 100 * ln['mfu'], '.1f')}% "
            f"| {_f(ln['peak_mem_gib'], '.2f')} | "
            + " / ".join(_f(split.get(k), ".3f") for k in SPLIT)
            + " |"
        )
    out += [
        "",
        "tokens/s/GPU counts non-padding tokens; slot tok/s/GPU counts global batch × seq_len per step, "
        "the planner's basis, so meas/pred = predicted step time / measured median step time. "
        "Host fp32: one thread's matmul rate, measured just before the run for its prediction "
        "(cluster.host_probe; the VM's speed drifts over minutes). "
        "Spread = (max − min) / median over the measured steps. CPU s/step: CPU seconds of the busiest "
        "worker process (median step), the basis local_cpu was calibrated on. On CPU, GiB is the peak resident memory "
        "of a worker and TFLOP/s/MFU are against conf/cluster's nominal peak. Split: mean seconds per "
        "step, averaged over ranks (fwd_bwd: the forward-backward schedule, TP collectives included; "
        "grad_sync: finalize_model_grads; pp_p2p: pipeline sends/receives including waits; other: "
        "the rest of the step)."
        + (
            " Planner fit: whether the planner's constants were fitted to the run (fitted) or not "
            "(held out: its meas/pred is out of sample)."
            if marked
            else ""
        ),
        *_by_fit(lines),
    ]
    return out


def _by_fit(lines: list[dict]) -> list[str]:
    """Median and range of meas/pred over the fitted runs and over the held-out ones."""
    out = []
    for held, name in ((False, "fitted"), (True, "held out")):
        for key, what in (("measured_over_predicted", "meas/pred"),
                          ("measured_over_predicted_cpu", "meas/pred (CPU s)")):  # fmt: skip
            r = [ln[key] for ln in lines if ln.get("held_out") is held and ln.get(key)]
            if r:
                out.append(f"- {name} runs ({len(r)}): {what} median {statistics.median(r):.2f}, "
                           f"range {min(r):.2f}–{max(r):.2f}")  # fmt: skip
    return ["", *out] if out else []


def plot(lines: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    vs_hf = bool(lines) and lines[0].get("kind") == "cpu_vs_hf"
    if lines and lines[0].get("kind") == "plan_search":
        ok = [ln for ln in lines if ln.get("status") == "ok"]
        fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(ok) + 2), 4.5))
        ax.bar(range(len(ok)), [ln["wall_s"] for ln in ok], color="tab:blue")
        ax.axhline(60, color="tab:red", linestyle="--")
        ax.set_ylabel("wall s: plan.search=true")
        ax.set_xticks(list(range(len(ok))))
        ax.set_xticklabels([f"{ln['label']} r{ln['round']}" for ln in ok], rotation=60, ha="right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    if lines and lines[0].get("kind") == "host_overhead":
        ok = [ln for ln in lines if ln.get("status") == "ok"]
        fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(ok) + 2), 4.5))
        ax.bar(range(len(ok)), [ln["cpu_ms"] for ln in ok],
               color=["tab:gray" if ln["side"] == "hf" else "tab:blue" for ln in ok])  # fmt: skip
        ax.set_ylabel("CPU ms per training step (median)")
        ax.set_xticks(list(range(len(ok))))
        ax.set_xticklabels([f"{ln['label']} r{ln['round']}" for ln in ok], rotation=30, ha="right")
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return
    ok = [ln for ln in lines if ln.get("status") == "ok"]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * (4 if vs_hf else len(ok)) + 2), 4.5))
    if vs_hf:
        plot_vs_hf(ax, lines)
    else:
        labels, x = [r["label"] for r in ok], range(len(ok))
        w = 0.4
        meas = [ln["slot_tokens_per_s_per_gpu"] for ln in ok]
        pred = [(ln.get("predicted") or {}).get("tokens_per_s_per_gpu") or 0 for ln in ok]
        ax.bar([i - w / 2 for i in x], meas, w, label="measured")
        ax.bar([i + w / 2 for i in x], pred, w, label="planner", color="tab:orange")
        ax.set_ylabel("tokens/s/GPU (global batch × seq_len)")
        ax.legend()
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=30, ha="right")
    ax.set_title(f"bench {lines[0]['bench']} ({lines[0]['invocation']})" if lines else "bench")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(out_dir: Path) -> tuple[Path, Path]:
    """bench.md and bench.png of the latest invocation in out_dir/bench.jsonl (and bench.latest.jsonl:
    that invocation's lines alone, what a published report keeps beside it)."""
    lines = latest(read_lines(out_dir / "bench.jsonl"))
    md, png = out_dir / "bench.md", out_dir / "bench.png"
    if not lines:
        md.write_text("# bench\n\nno results yet\n")
        plot([], png)
        return md, png
    kind = lines[0].get("kind")
    if kind == "host_overhead":
        body = overhead_md(lines)
    elif kind == "plan_search":
        from ftcore.bench.plan_search import plan_search_md

        body = plan_search_md(lines)
    else:
        body = cpu_vs_hf_md(lines) if kind == "cpu_vs_hf" else layouts_md(lines)
    md.write_text("\n".join(_header(lines) + body) + "\n")
    plot(lines, png)
    (out_dir / "bench.latest.jsonl").write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return md, png


def published_stem(lines: list[dict], hardware: str) -> str:
    """`<bench>_<hardware>_<date>`: how reports are named in docs/bench/ (the invocation's day)."""
    inv = str(lines[0].get("invocation", ""))
    date = f"{inv[:4]}-{inv[4:6]}-{inv[6:8]}" if len(inv) >= 8 else "undated"
    return f"{lines[0]['bench']}_{hardware}_{date}"


def free_stem(docs_dir: Path, stem: str, invocation) -> str:
    """stem, or stem-2, -3, ... where a report of another invocation already has the name: a
    second run of the same bench on the same day and machine is a record of its own."""
    for k in range(1, 1000):
        name = stem if k == 1 else f"{stem}-{k}"
        raw = docs_dir / f"{name}.jsonl"
        if not raw.exists():
            return name
        published = read_lines(raw)
        if published and published[0].get("invocation") == invocation:
            return name  # the same invocation published again: its own files
    raise FtcoreError(f"{docs_dir}: too many {stem} reports", field="bench.publish", fix="tidy it")


def publish(out_dir: Path, docs_dir: Path, hardware: str) -> list[Path]:
    """Copy the latest invocation's bench.md, bench.png and its raw JSONL lines (each carries the
    command, commit, machine and package versions) to docs_dir/<bench>_<hardware>_<date>.*;
    the report's image link is rewritten to the copy's name."""
    lines = latest(read_lines(out_dir / "bench.jsonl"))
    if not lines:
        return []
    stem = free_stem(docs_dir, published_stem(lines, hardware), lines[0].get("invocation"))
    docs_dir.mkdir(parents=True, exist_ok=True)
    md = (out_dir / "bench.md").read_text()
    md += f"\n![{lines[0]['bench']}]({stem}.png)\n\nRaw lines: [{stem}.jsonl]({stem}.jsonl).\n"
    out = [docs_dir / f"{stem}.{ext}" for ext in ("md", "png", "jsonl")]
    out[0].write_text(md)
    out[1].write_bytes((out_dir / "bench.png").read_bytes())
    out[2].write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    return out
