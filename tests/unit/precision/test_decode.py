"""precision/decode.py (issue 41, item 5): generation and evaluation never inherit a training
setting Transformer Engine cannot run at decode shapes (FP8/FP4 GEMMs, userbuffers, CUDA graphs);
the trainer's own accuracy, which cannot change its model, is refused where the config has one."""

from __future__ import annotations

import pytest

from ftcore.config.schema import compose, conf_dir
from ftcore.errors import FtcoreError
from ftcore.precision.decode import decode_problems, decode_safe
from ftcore.validation.checks import validate
from tests.support.cli import QUESTION, cli
from tests.unit.precision.test_hardware import IMAGE, check_on_target

EXPS = sorted(p.stem for p in (conf_dir() / "exp").glob("*.yaml"))


@pytest.mark.parametrize("exp", EXPS)
def test_every_exp_decodes_after_derivation(exp):
    """Each experiment's derived config has nothing TE refuses at decode shapes, and validates
    on its target GPU for ftcore.generate / ftcore.eval (training=False)."""
    cfg = compose([f"+exp={exp}", "model.allow_random_base=true"])
    changes = decode_safe(cfg, say=False)
    assert decode_problems(cfg) == []
    if exp in ("70b_fp8", "405b_lora"):
        assert "precision fp8_cs -> bf16" in changes and cfg.precision.fp8_recipe is None
    if exp in ("70b_fp8", "70b_lora", "405b_lora"):
        assert "parallel.tp_comm_overlap true -> false" in changes
    from ftcore.precision import hardware

    device = hardware.simulated_device(cfg, te=IMAGE.te, cuda_version=IMAGE.cuda)
    validate(cfg, cfg.cluster.num_gpus or 1, training=False, device=device)


@pytest.mark.parametrize("exp", ["70b_fp8", "70b_lora", "405b_lora"])
def test_training_accuracy_on_a_decode_unsafe_config_is_refused(exp):
    cfg = compose([f"+exp={exp}", "model.allow_random_base=true", "eval.accuracy=true"])
    with pytest.raises(FtcoreError) as e:
        check_on_target(cfg, cfg.cluster.num_gpus)
    assert e.value.field == "eval.accuracy" and "ftcore.eval" in e.value.fix
    assert "tp_comm_overlap" in str(e.value)


def test_generate_and_eval_run_an_fp8_experiment_decode_safe(tmp_path):
    """End to end on CPU: an FP8 config (refused on CPU before: FP8 needs a GPU) generates and
    scores accuracy in its BF16 form, and says so."""
    gen = cli("generate", "+exp=tiny_lora", "precision=fp8_cs", *QUESTION)
    assert gen.returncode == 0, gen.stderr[-2000:]
    assert "decode-safe" in gen.stderr and "precision fp8_cs -> bf16" in gen.stderr
    ev = cli("eval", "+exp=tiny_lora", "precision=fp8_cs", "eval.accuracy=true",
             "eval.max_samples=2", f"eval.output={tmp_path / 'eval.json'}",
             f"run.dir={tmp_path}")  # fmt: skip
    assert ev.returncode == 0, ev.stderr[-2000:]
    assert "accuracy" in (tmp_path / "eval.json").read_text()
