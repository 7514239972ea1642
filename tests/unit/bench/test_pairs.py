"""cpu_vs_hf's pairing and refusal (ftcore.bench.pairs), the step groups and timed span both sides
share (ftcore.bench.steps), and the jobs of a round (vs_hf.plan): in-process, no training."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ftcore.bench import steps
from ftcore.bench.pairs import compare, headline, models_of, pairs_of
from ftcore.config.schema import compose
from ftcore.errors import FtcoreError


def _side(side, label, rnd=1, **kw):
    line = {"side": side, "label": label, "round": rnd, "model": "4L", "pair": "packed",
            "status": "ok", "steps": 10, "measured_steps": 8, "groups_digest": "abc",
            "tokens": 800, "target_tokens": 120, "epoch_tokens": 1000, "epoch_target_tokens": 150,
            "eval_loss": 5.0, "tokens_per_s": 100.0, "cpu_s": 8.0, "efficiency": 0.1}  # fmt: skip
    return {**line, **kw}


def test_same_documents_and_close_losses_are_comparable():
    hf, ft = _side("hf", "hf-flattened"), _side("ftcore", "ftcore-packed", tokens_per_s=150.0,
                                                   cpu_s=5.0, eval_loss=5.05)  # fmt: skip
    c = compare(hf, ft, 0.02)
    assert c["comparable"] and c["reason"] is None
    assert c["ratio_vs_hf"] == 1.5 and c["ratio_vs_hf_cpu"] == 1.6
    assert c["eval_loss_rel_diff"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    "change, why",
    [
        ({"tokens": 801}, "tokens: ftcore 801, HF 800"),
        ({"target_tokens": 119}, "target_tokens"),
        ({"groups_digest": "abd"}, "groups_digest"),
        ({"steps": 11}, "steps"),
        ({"epoch_tokens": 999}, "epoch_tokens"),
        (
            {"eval_loss": 5.2},
            "eval loss 5.2000 vs HF 5.0000 (+4.0%, over bench.loss_tolerance 0.02)",
        ),
        ({"eval_loss": float("nan")}, "eval loss nan"),
        ({"status": "failed"}, "a side failed"),
    ],
)
def test_what_differs_is_refused_with_the_reason(change, why):
    c = compare(_side("hf", "hf-padded"), _side("ftcore", "ftcore-padded", **change), 0.02)
    assert c["comparable"] is False and why in c["reason"]


def test_headline_takes_medians_over_comparable_rounds_only():
    lines = []
    for rnd, (ratio, ok) in enumerate([(1.5, True), (1.2, True), (9.0, False), (1.3, True)], 1):
        lines.append(_side("hf", "hf-flattened", rnd, efficiency=0.10 + rnd / 100))
        lines.append(_side("ftcore", "ftcore-packed", rnd, ratio_vs_hf=ratio, comparable=ok,
                           reason=None if ok else "tokens: ftcore 1, HF 2",
                           ratio_vs_hf_cpu=ratio - 0.1, efficiency=0.2))  # fmt: skip
    (h,) = headline(lines)
    assert (h["rounds"], h["comparable_rounds"]) == (4, 3)
    assert h["ratio"] == 1.3 and h["ratio_range"] == (1.2, 1.5)
    assert h["ratio_cpu"] == pytest.approx(1.2) and h["eff_hf"] == pytest.approx(0.12)
    assert h["refused"] == ["round 3: tokens: ftcore 1, HF 2"]
    assert (h["ftcore"], h["hf"], h["tokens"]) == ("ftcore-packed", "hf-flattened", 800)


def _bench(**kw):
    base = {"name": "t", "kind": "cpu_vs_hf", "sweep": {}, "models": [], "loss_tolerance": 0.02,
            "runs": [{"label": "packed", "hf": "flattened", "overrides": ["data.packing=true"]}]}  # fmt: skip
    return OmegaConf.create({**base, **kw})


def test_every_run_names_its_hf_recipe_and_models_are_distinct():
    (p,) = pairs_of(_bench())
    assert (p.run.label, p.hf) == ("packed", "flattened")
    with pytest.raises(FtcoreError, match="flattened .for ftcore packed. or padded") as e:
        pairs_of(_bench(runs=[{"label": "x", "overrides": []}]))
    assert e.value.field == "bench.runs[0].hf"
    with pytest.raises(FtcoreError, match="sweep"):
        pairs_of(_bench(sweep={"data.packing": [True, False]}))
    assert [m.label for m in models_of(_bench())] == ["model"]
    two = [{"label": "4L", "shape": {"num_hidden_layers": 4}}, {"label": "4L"}]
    with pytest.raises(FtcoreError, match="duplicate model labels"):
        models_of(_bench(models=two))
    with pytest.raises(FtcoreError, match="relative tolerance"):
        models_of(_bench(loss_tolerance=2.0))


def test_a_round_runs_every_pair_on_every_model_from_the_same_overrides(tmp_path):
    """Per model, per pair: the HF recipe (its collator, the warm-up) then the ftcore run, both
    configured from the same overrides on that model's directory."""
    from ftcore.bench.runner import Bench
    from ftcore.bench.vs_hf import plan

    cfg = compose(["bench=cpu_vs_hf_smoke", f"bench.output_dir={tmp_path}"])
    b = Bench(cfg, ["optim.lr=3e-4"], "test")
    pairs, models = pairs_of(cfg.bench), models_of(cfg.bench)
    assert [m.label for m in models] == ["1L", "2L"] and [p.hf for p in pairs] == [
        "flattened",
        "padded",
    ]
    for m in models:
        d = Path(f"/models/{m.label}")
        jobs = plan(b, m, pairs, d, tmp_path / m.label, 1)
        assert [j[0].rsplit(".", 1)[1] for j in jobs] == ["hf_recipe", "worker"] * 2
        for (_, _, hf_spec, _, _), (_, ft_ov, ft_spec, _, _), p in zip(
            jobs[::2], jobs[1::2], pairs
        ):
            assert hf_spec["collator"] == p.hf and hf_spec["optim"] == "adamw_torch_fused"
            assert hf_spec["warmup"] == ft_spec["warmup"] == 2
            assert ft_ov[: len(hf_spec["overrides"])] == hf_spec["overrides"]
            assert f"model.hf_path={d}" in hf_spec["overrides"] and "optim.lr=3e-4" in ft_ov


class _Turn:
    def __init__(self):
        self.waited_s = self.waited_cpu_s = 0.0


def test_the_span_starts_after_warmup_and_leaves_out_the_turns(monkeypatch):
    clock = steps.StepClock(_Turn())
    turn = clock.turn
    now = iter([0.0, 1.0, 2.0, 10.0, 11.0])  # marks: start, steps 1-4; 7 s waited after step 2
    monkeypatch.setattr(steps.time, "perf_counter", lambda: next(now))
    monkeypatch.setattr(steps.time, "process_time", lambda: 0.0)
    for i in range(5):
        clock.mark()
        if i == 2:
            turn.waited_s, turn.waited_cpu_s = 7.0, 0.0
    span = clock.span(1)
    assert span == {"wall_s": 3.0, "cpu_s": 0.0, "waited_s": 7.0, "cpu_waited_s": 0.0,
                    "measured_steps": 3}  # fmt: skip
    with pytest.raises(FtcoreError, match="bench.warmup_steps=4"):
        steps.check_warmup(4, 4)


def test_step_groups_are_the_batches_ftcore_s_loader_hands_out():
    """A fresh loader's groups (what the HF recipe gets) are what another loader of the same
    config hands its trainer, packed rows of several documents included."""
    from ftcore.data.pipeline import build_train_loader
    from ftcore.data.tokenizer import load_tokenizer

    cfg = compose(["+exp=tiny_full", "data.packing=true", "data.seq_len=64", "data.max_samples=40",
                   "train.global_batch_size=2", "train.micro_batch_size=1"])  # fmt: skip
    tok = load_tokenizer(cfg)
    fresh, trained = build_train_loader(cfg, tok, 0, 1), build_train_loader(cfg, tok, 0, 1)
    n = steps.epoch_steps(fresh.report["rows"], 2)
    groups = steps.step_groups(fresh, n)
    seen = steps.record_groups(trained)
    for _ in range(n):
        trained.next_microbatches()
    assert seen == groups and steps.digest(seen) == steps.digest(groups)
    assert any(len(g) > 2 for g in groups)  # rows hold several documents
    assert set(fresh.sampler.epoch_docs(0).tolist()) <= {d for g in groups for d in g}
