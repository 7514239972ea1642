"""The plan as a human-readable table (plan.format=table)."""

from __future__ import annotations

TERMS = ("weights", "grads", "optimizer", "activations", "reserve", "load_peak", "total")


def _params_line(p: dict) -> str:
    par = p["params"]
    line = f"params: {par['total'] / 1e9:.2f} B total, {par['active'] / 1e9:.2f} B active per token"
    if "base" in par and par["base"] != par["total"]:
        line += f" (the base model {par['base'] / 1e9:.2f} B, the rest adapters)"
    if "mtp" in par:
        line += (f"; the checkpoint's multi-token-prediction layers {par['mtp'] / 1e9:.2f} B more "
                 f"({(par['base'] + par['mtp']) / 1e9:.2f} B with them), carried into the export, "
                 "not built")  # fmt: skip
    if "moe" in par:
        e = par["moe"]
        line += (
            f"; {e['moe_layers']} MoE layers of {e['experts']} experts, top-{e['topk']}: "
            f"{e['experts_per_ep_rank']} experts per EP rank (ep={p['layout']['ep']}, "
            f"etp={p['layout']['etp']}), expert state sharded over an expert data-parallel "
            f"group of {e['expert_dp']}; routed activations and time at {e['routed_factor']:g} x "
            "the mean on the busiest rank (plan.moe_imbalance, or moe.capacity_factor)"
        )
    return line


def _search_rows(ranked: list[dict], moe: bool) -> list[str]:
    lines = [
        "    tp  pp  vp  cp  dp"
        + ("  ep etp" if moe else "")
        + "  sp mbs recompute    GiB  spare  tokens/s/GPU   MFU variants"
    ]
    for r in ranked:
        lines.append(
            f"  {r['tp']:>4}{r['pp']:>4}{r['vp']:>4}{r['cp']:>4}{r['dp']:>4}"
            + (f"{r['ep']:>4}{r['etp']:>4}" if moe else "")
            + f"{'yes' if r['sp'] else 'no':>4}{r['micro_batch_size']:>4} "
            f"{r['recompute']:<10}{r['memory_gib']:>6.1f}{r['spare_gib']:>7.1f}"
            f"{r['tokens_per_s_per_gpu']:>14.0f}"
            f"{100 * r['mfu']:>6.1f}{r['variants']:>9}"
        )
        lines.append(f"      {r['overrides']}")
    if not ranked:
        lines.append("  (none)")
    return lines


def table(
    p: dict,
    ranked: list[dict] | None = None,
    search_world: int | None = None,
    fewest: dict | None = None,
) -> str:
    lay = p["layout"]
    lines = [f"note: {n}" for n in p.get("notes", [])] + [
        f"plan: {p['model']} {'full' if p['peft'] == 'none' else p['peft']} {p['precision']} on {p['num_gpus']} x {p['cluster']} "
        f"({p['gpu_mem_gib']:.1f} GiB each)",
        "layout: " + " ".join(f"{k}={v}" for k, v in lay.items()),
        _params_line(p),
        "",
        "memory per GPU (GiB)  " + "".join(f"{t:>12}" for t in TERMS) + "   layers",
    ]
    for s in p["stages"]:
        mem = s["memory_gib"]
        mark = " <- worst" if s["pp_rank"] == p["worst_stage"] and len(p["stages"]) > 1 else ""
        lines.append(
            f"  pp stage {s['pp_rank']:<11}"
            + "".join(f"{mem[t]:12.2f}" for t in TERMS)
            + f"   {s['layers']:>6}{mark}"
        )
    w = p["stages"][p["worst_stage"]]["parts"]
    lines += [
        "",
        f"worst stage detail: frozen weights {w['frozen_weights']:.2f}, trainable weights "
        f"{w['trainable_weights']:.2f}, quantized weight copies {w['quantized_weights']:.2f}; "
        f"activations = {w['layer_activation'] * 1024:.1f} MiB/layer x {w['layers_in_flight']} "
        f"layer-microbatches in flight + loss {w['loss_activations']:.2f} + pipeline buffers "
        f"{w['pipeline_buffers'] + w['masks']:.2f} + the larger of logits {w['logits_transient']:.2f} "
        f"(with the loss) and a recomputed layer {w['recompute_transient']:.2f}; load peak = loaded "
        f"weights {w['load_resident']:.2f} + full-precision shard in flight "
        f"{w['load_shard_in_flight']:.2f} (total: the larger of training and load, + reserve"
        + (f", which holds TE's userbuffers {w['userbuffers']:.2f}" if w.get("userbuffers") else "")
        + ")",
        f"the config's layout (above) fits: {'yes' if p['fits'] else 'NO'} ({p['memory_gib']['total']:.1f} of "
        f"{p['gpu_mem_gib']:.1f} GiB, {p['spare_gib']:.1f} spare, {p['headroom_gib']:.1f} kept as "
        f"headroom: plan.headroom of the estimated activations); fewest GPUs that fit: "
        f"{p['gpus_needed']}",
        f"speed: {p['tokens_per_s_per_gpu']:.0f} tokens/s/GPU, {p['model_tflops_per_gpu']:.0f} model "
        f"TFLOP/s/GPU, MFU {100 * p['mfu']:.1f}% ({p['mfu_basis']}); step {p['step_time_s']:.2f} s = "
        + ", ".join(f"{k} {v:.3f}" for k, v in p["step_time_parts_s"].items() if v),
        *_grpo_lines(p),
        "what the numbers rest on:",
        *(f"  {k.replace('_', ' ')}: {v}" for k, v in p["labels"].items()),
    ]
    if "dry_build" in p:
        lines += [
            "",
            f"dry build on the meta device (a rank of each distinct pipeline stage of "
            f"{p['num_gpus']} GPUs):",
        ]
        for e in p["dry_build"]:
            off = e["off_device"]
            where = (
                f"{len(off)} off the device: {', '.join(off[:3])}" if off else "all on the device"
            )
            same = "=" if e["params"] == e["planned_params"] else "!="
            lines.append(
                f"  pp stage {e['pp_rank']:<4} {e['params']:>16,d} elements built {same} "
                f"{e['planned_params']:,d} planned; {where}{' ...' if len(off) > 3 else ''}"
            )
    if ranked is not None:
        moe = "moe" in p["params"]
        world = search_world or p["num_gpus"]
        lines += ["", f"search: the layouts on {world} GPUs that fit (the headroom kept), "
                  "fastest first, each with the overrides that select it (variants: settings of "
                  "the same tp/pp/cp within 2% of its speed, shown once):"]  # fmt: skip
        lines += _search_rows(ranked, moe)
        if fewest is not None:
            n = fewest["num_gpus"]
            lines += ["", f"none fits on {world} GPUs; on {n}, the fewest that fit "
                      f"(add cluster.num_gpus={n} to the overrides):"]  # fmt: skip
            lines += _search_rows(fewest["rows"], moe)
    return "\n".join(lines)


def _grpo_lines(p: dict) -> list[str]:
    """objective=grpo: the step's rollout, forward-only passes and update apart (planner/grpo.py)."""
    g = p.get("grpo")
    if g is None:
        return []
    mu, lens = g["num_iterations"], g["priced_lengths"]
    cache = (
        "no KV cache (sequence parallelism): the prefix recomputed per token"
        if g["kv_cache_recomputed"]
        else "KV cache"
    )
    return [
        f"grpo step {g['step_time_s']:.2f} s = rollout {g['rollout_s']:.2f} s / {mu} + forward-only "
        f"passes {g['forward_only_s']:.2f} s / {mu} ({g['forward_only_passes']}: reference, old "
        f"log-probs) + update {g['update_s']:.2f} s; the rollout is {100 * g['rollout_share']:.0f}% "
        f"of a step",
        f"  rollout: {g['completions_per_replica']} completions per replica, prompts read in "
        f"{g['prefill_s']:.2f} s, then {1000 * g['decode_token_s']:.1f} ms per token ({cache}); "
        f"priced at prompt {lens['prompt']} + completion {lens['completion']} tokens (an upper bound)",
    ]
