"""Issue 31, from the command line as a user types it: nothing silently wrong (an adapter path is
used or refused, never dropped; no adapters on a random base; a GPU experiment on a machine without
one), and every path checked before anything is built. Each case: the exit status, the one
`ftcore error:` line, and what was (not) written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ftcore.config.schema import compose
from ftcore.errors import FtcoreError
from ftcore.peft.config import Geometry, LoraSettings
from ftcore.validation.checks import validate
from tests.support.cli import QUESTION, cli, error_line  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="tests the refusal without CUDA")


def tiny_adapter(path: Path, base: str | None = "tiny_base", std: float = 0.5) -> Path:
    """A PEFT LoRA adapter for the bundled tiny base (conf/model/tiny), with weights large enough
    to change its greedy answers."""
    from ftcore.peft.adapter_format import save_adapter

    g, gen = Geometry(256, 704, 8, 4, 32), torch.Generator().manual_seed(0)
    targets, r, sd = ["q_proj", "v_proj"], 4, {}
    for i in range(4):
        for s in targets:
            o, n = g.out_in(s)
            key = f"base_model.model.model.layers.{i}.self_attn.{s}"
            sd[f"{key}.lora_A.weight"] = torch.randn(r, n, generator=gen) * std
            sd[f"{key}.lora_B.weight"] = torch.randn(o, r, generator=gen) * std
    save_adapter(path, sd, LoraSettings(r, 8.0, 0.0, tuple(targets), False), targets, base)
    return path


# ---- an adapter path is used or refused, never dropped ----------------------------------------


def test_generate_uses_an_adapter_given_without_peft_lora(base_answer, tmp_path):
    """`ftcore.generate peft.adapter_path=DIR` loads DIR as LoRA on the base its config names: the
    same answer as spelling it all out, not the base's answer (base_answer: the same question to
    +exp=tiny_lora without the adapter), nor a random model's."""
    ad = tiny_adapter(tmp_path / "hf_adapter")
    common = [*QUESTION, f"run.dir={tmp_path / 'run'}"]
    alone = cli("generate", f"peft.adapter_path={ad}", *common)
    spelled = cli("generate", "+exp=tiny_lora", f"peft.adapter_path={ad}", *common)
    base = base_answer[0]
    for p in (alone, spelled, base):
        assert p.returncode == 0, p.stderr[-3000:]
    assert alone.stdout == spelled.stdout, (alone.stdout, spelled.stdout)
    assert alone.stdout != base.stdout, "the adapter changed nothing: the test proves nothing"
    assert "as a LoRA adapter" in alone.stderr and "model.init_path=tiny_base" in alone.stderr


def test_train_refuses_an_adapter_next_to_full_fine_tuning(tmp_path):
    ad = tiny_adapter(tmp_path / "hf_adapter")
    run = tmp_path / "run"
    line = error_line(cli("train", "+exp=tiny_full", f"peft.adapter_path={ad}", f"run.dir={run}"))
    assert "peft.adapter_path:" in line and "peft=lora" in line
    assert not run.exists()


def test_train_goes_on_training_an_adapter_on_the_base_it_names(tmp_path):
    from ftcore.validation.preflight import use_adapter

    ad = tiny_adapter(tmp_path / "hf_adapter")
    cfg = use_adapter(compose(["peft=lora", f"peft.adapter_path={ad}"]), training=True)
    assert cfg.model.init_path == "tiny_base"
    validate(cfg, 1)
    hub = tiny_adapter(tmp_path / "hub_adapter", base="meta-llama/Llama-3.1-8B")
    cfg = use_adapter(compose(["peft=lora", f"peft.adapter_path={hub}"]), training=True)
    with pytest.raises(FtcoreError) as e:  # a Hub name is never fetched: say which base it wants
        validate(cfg, 1)
    assert e.value.field == "model.hf_path" and "meta-llama/Llama-3.1-8B" in str(e.value)


def test_an_adapters_relative_base_is_not_resolved_against_the_cwd(tmp_path, monkeypatch):
    """Issue 46: a downloaded adapter naming `some/dir` must not pick whatever base sits at that
    path under the current directory; only an absolute path (or model.hf_path) names a base."""
    from ftcore.validation.preflight import use_adapter

    (tmp_path / "models" / "base").mkdir(parents=True)  # someone else's base, where it points
    (tmp_path / "models" / "base" / "config.json").write_text("{}")
    ad = tiny_adapter(tmp_path / "hf_adapter", base="models/base")
    monkeypatch.chdir(tmp_path)
    cfg = use_adapter(compose(["peft=lora", f"peft.adapter_path={ad}"]), training=True)
    assert not cfg.model.hf_path and not cfg.model.init_path
    with pytest.raises(FtcoreError) as e:
        validate(cfg, 1)
    assert e.value.field == "model.hf_path" and "models/base" in str(e.value)
    absolute = tiny_adapter(tmp_path / "abs_adapter", base=str(tmp_path / "models" / "base"))
    cfg = use_adapter(compose(["peft=lora", f"peft.adapter_path={absolute}"]), training=True)
    assert cfg.model.hf_path == str(tmp_path / "models" / "base")


# ---- no adapters on a random base -------------------------------------------------------------


def test_lora_on_a_random_base_is_refused(tmp_path):
    run = tmp_path / "run"
    line = error_line(cli("train", "+exp=tiny_lora", "model.init_path=null", f"run.dir={run}"))
    assert line.startswith("ftcore error: model.hf_path:") and "random" in line
    assert "model.allow_random_base=true" in line
    assert not run.exists()


def test_allow_random_base_and_a_given_base_pass():
    validate(compose(["+exp=tiny_lora", "model.init_path=null", "model.allow_random_base=true"]), 1)
    validate(compose(["+exp=tiny_lora"]), 1)  # the preset's bundled base
    with pytest.raises(FtcoreError) as e:
        validate(compose(["+exp=tiny_full", "peft=qlora"]), 1)
    assert e.value.field == "model.hf_path"


def test_a_user_hf_path_wins_over_the_presets_bundled_base(tmp_path):
    from ftcore.config.schema import assets_dir
    from ftcore.hf.io import weights_source

    cfg = compose(["+exp=tiny_lora", f"model.hf_path={assets_dir() / 'tiny_base'}"])
    validate(cfg, 1)
    assert weights_source(cfg)[1] == "model.hf_path"


# ---- a GPU experiment on a machine without one ------------------------------------------------


@NO_CUDA
@pytest.mark.parametrize("module", ["train", "eval", "generate"])
def test_gpu_cluster_without_cuda_is_refused_first(module, tmp_path):
    run = tmp_path / "run"
    # data.path is missing too: the missing GPU is what the user must hear first
    line = error_line(cli(module, "+exp=70b_full", f"data.path={tmp_path / 'nope.jsonl'}",
                          f"run.dir={run}", timeout=120))  # fmt: skip
    assert line.startswith("ftcore error: cluster:") and "no CUDA device was found" in line
    assert "cluster=local_cpu" in line and "slurm/" in line
    assert not run.exists()


def test_plan_still_works_without_a_gpu():
    proc = cli("plan", "+exp=405b_lora", "plan.format=json")
    assert proc.returncode == 0, proc.stderr[-2000:]


# ---- every path is checked before anything is built -------------------------------------------


MISSING = "/no/such/path"


@pytest.mark.parametrize(
    "override,field",
    [
        (f"data.path={MISSING}.jsonl", "data.path"),
        (f"data.val_path={MISSING}.jsonl", "data.val_path"),
        (f"data.mix=[{{path: {MISSING}.jsonl}}]", "data.mix[0].path"),
        (f"model.hf_path={MISSING}", "model.hf_path"),
        (f"model.tokenizer={MISSING}", "model.tokenizer"),
        (f"model.init_path={MISSING}", "model.init_path"),
        (f"checkpoint.resume={MISSING}", "checkpoint.resume"),
    ],
    ids=["data", "val_data", "mix", "hf_path", "tokenizer", "init_path", "resume"],
)
def test_a_missing_path_is_named_before_anything_is_built(override, field, tmp_path, capsys):
    """In process (the same cli.main a user's command runs) to keep the suite quick; the data
    path case runs as a subprocess as well."""
    from ftcore.cli import main
    from ftcore.train import task

    run = tmp_path / "run"
    assert main("train", task, ["+exp=tiny_full", override, f"run.dir={run}"]) == 2
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("ftcore error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"ftcore error: {field}:") and MISSING in lines[0], lines[0]
    assert not run.exists(), "nothing is written before the inputs are checked"


def test_a_missing_data_file_from_the_command_line(tmp_path):
    run = tmp_path / "run"
    proc = cli("train", "+exp=tiny_full", f"data.path={tmp_path / 'typo.jsonl'}", f"run.dir={run}")
    assert error_line(proc).startswith("ftcore error: data.path:") and not run.exists()


def test_a_missing_adapter_is_named(tmp_path):
    with pytest.raises(FtcoreError) as e:
        validate(compose(["+exp=tiny_lora", f"peft.adapter_path={tmp_path / 'none'}"]), 1)
    assert e.value.field == "peft.adapter_path"
