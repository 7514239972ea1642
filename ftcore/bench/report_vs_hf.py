"""bench.md's body for cpu_vs_hf: the four comparisons' medians, every round's lines, and what the
ratios do and do not say about GPUs; and its plot (median ratio per comparison)."""

from __future__ import annotations

import math

from ftcore.bench.pairs import headline

CAPTION = """\
What is timed: each side from the end of optimizer step {warmup} to the end of its last step
(wall via perf_counter, CPU via process_time), less the time it waited for its turn; tokens and
target tokens are counted over those measured steps. Both sides of a pair train on the same
documents in the same optimizer steps (ftcore's loader says which; the HF Trainer is given them as
its batches), so they run the same steps over the same tokens; `ftcore-packed` is paired with HF's
padding-free `DataCollatorWithFlattening`, `ftcore-padded` with `DataCollatorForSeq2Seq` (both:
PEFT LoRA, SDPA, fused AdamW). × HF = HF wall / ftcore wall for the same tokens; × HF (CPU) the same
with CPU seconds of the process (all threads). Model FLOP/s = model FLOPs per token (ftcore.planner.
flops: 4N' for LoRA, 6N' + attention for full; the same number on both sides) × measured tokens /
wall; % of GEMM divides it by the best fp32 square GEMM ({gemm}) on the same threads, measured
just before and just after each model's runs in each round (the faster of the two). A pair whose steps, step documents or tokens differ, or whose validation
losses after the epoch differ by more than {tol:.0%}, is marked not comparable and left out of the
medians.

What this says about GPUs, and what it does not: these are fp32 runs on a CPU, with no tensor cores
and no kernel launches to hide host work behind. What carries over is host overhead per layer and
micro-batch (Python, dispatch, the optimizer's per-tensor work), work not spent on padding, and
the step groups (the same documents per step on both sides). What does not: on a GPU the frozen
base's GEMMs dominate a LoRA step and host overhead hides behind running kernels, so ratios there
are smaller where GEMMs are large; and on these shallow models computing the LM head and the last
layer only at target positions saves a larger share than on a real 32-80 layer model, so the
shallow rows overstate that saving (compare the deeper rows)."""


def _f(x, fmt: str = ".0f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return format(x, fmt)


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _gemm_txt(lines: list[dict]) -> str:
    rates = {(ln.get("round"), ln.get("model")): ln.get("gemm_flops_per_s") for ln in lines
             if ln.get("gemm_flops_per_s")}  # fmt: skip
    g = next((ln.get("gemm") for ln in lines if ln.get("gemm")), None) or {}
    if not rates:
        return "not measured"
    lo, hi = min(rates.values()) / 1e9, max(rates.values()) / 1e9
    span = f"{lo:.0f}" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}"
    return f"{g.get('size')}² fp32 on {g.get('threads')} threads: {span} GFLOP/s"


def headline_md(lines: list[dict]) -> list[str]:
    out = [
        "| model | ftcore vs HF | comparable rounds | median × HF (wall) | range | median × HF (CPU s) "
        "| ftcore % of GEMM | HF % of GEMM | eval loss ftcore / HF | measured tokens / target tokens |",
        "|---|---|---:|---:|---|---:|---:|---:|---|---|",
    ]
    refused = []
    for h in headline(lines):
        lo_hi = h["ratio_range"]
        out.append(
            f"| {h['model']} | {h['ftcore']} vs {h['hf']} | {h['comparable_rounds']}/{h['rounds']} "
            f"| **{_f(h['ratio'], '.2f')}** | {f'{lo_hi[0]:.2f}–{lo_hi[1]:.2f}' if lo_hi else '–'} "
            f"| {_f(h['ratio_cpu'], '.2f')} | {_pct(h['eff_ftcore'])} | {_pct(h['eff_hf'])} "
            f"| {_f(h['eval_ftcore'], '.4f')} / {_f(h['eval_hf'], '.4f')} "
            f"| {_f(h['tokens'])} / {_f(h['target_tokens'])} |"
        )
        refused += [f"- {h['model']} {h['ftcore']} vs {h['hf']}, {r}" for r in h["refused"]]
    out.append("")
    if refused:
        out += ["Not comparable (left out of the medians):", "", *refused, ""]
    return out


def rounds_md(lines: list[dict]) -> list[str]:
    out = [
        "| round | model | side | run | steps (measured) | tokens | target tokens | train loss "
        "| eval loss | wall s | CPU s | tokens/s | model GFLOP/s | % of GEMM | × HF | × HF (CPU) "
        "| comparable |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for ln in lines:
        head = f"| {ln.get('round')} | {ln.get('model')} | {ln.get('side')} | {ln.get('label')} "
        if ln.get("status") != "ok":
            out.append(head + f"| failed: {str(ln.get('error', ''))[:120]} |||||||||||||")
            continue
        hf = ln.get("side") == "hf"
        verdict = "" if hf else ("yes" if ln.get("comparable") else f"no: {ln.get('reason')}")
        mflops = ln.get("model_flops_per_s")
        out.append(
            head + f"| {ln['steps']} ({ln.get('measured_steps')}) | {ln['tokens']} "
            f"| {ln['target_tokens']} | {_f(ln.get('train_loss'), '.4f')} "
            f"| {_f(ln.get('eval_loss'), '.4f')} | {_f(ln['wall_s'], '.2f')} "
            f"| {_f(ln.get('cpu_s'), '.2f')} | {_f(ln['tokens_per_s'])} "
            f"| {_f(mflops and mflops / 1e9, '.1f')} | {_pct(ln.get('efficiency'))} "
            f"| {'1.00' if hf else _f(ln.get('ratio_vs_hf'), '.2f')} "
            f"| {'1.00' if hf else _f(ln.get('ratio_vs_hf_cpu'), '.2f')} | {verdict} |"
        )
    return [*out, ""]


def cpu_vs_hf_md(lines: list[dict]) -> list[str]:
    first = next((ln for ln in lines if ln.get("status") == "ok"), lines[0])
    turns = max((ln.get("turns") or 0 for ln in lines), default=0)
    order = (f"the four processes of a model's pairs side by side, taking turns in {turns} slices of "
             "their epochs" if turns else "each pair's HF run, then its ftcore run")  # fmt: skip
    rounds = max((ln.get("round") or 1 for ln in lines), default=1)
    tol = next((ln.get("loss_tolerance") for ln in lines if ln.get("loss_tolerance")), 0.02)
    return [
        f"{rounds} round(s); in each, per model: the host's fp32 GEMM rate, {order}, the GEMM rate "
        "again; "
        "epoch tokens per side are in bench.jsonl (`epoch_tokens`).",
        "",
        *headline_md(lines),
        *rounds_md(lines),
        CAPTION.format(warmup=first.get("warmup_steps", "W"), gemm=_gemm_txt(lines), tol=tol),
    ]


def plot_vs_hf(ax, lines: list[dict]) -> None:
    """One bar per comparison: the median wall ratio over comparable rounds, its range."""
    rows = [h for h in headline(lines) if h["ratio"]]
    x = range(len(rows))
    vals = [h["ratio"] for h in rows]
    err = [[v - h["ratio_range"][0] for v, h in zip(vals, rows)],
           [h["ratio_range"][1] - v for v, h in zip(vals, rows)]]  # fmt: skip
    ax.bar(x, vals, yerr=err if rows else None, color="tab:blue", capsize=4)
    ax.axhline(1.0, color="tab:gray", lw=1)
    for i, v in enumerate(vals):
        ax.annotate(f"{v:.2f}x", (i, v), ha="center", va="bottom")
    ax.set_ylabel("× HF, same documents and steps (median of rounds)")
    ax.set_xticks(list(x))
    ax.set_xticklabels([f"{h['model']} {h['ftcore']}\nvs {h['hf']}" for h in rows], fontsize=8)
