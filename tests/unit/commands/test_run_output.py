"""Issue 31, output a person can follow, from the command line as a user types it: the run
directory at the start and a summary at the end (whose generate command works as printed); eval,
generate and a failed run leave no timestamped directory among the training runs; export says what
it wrote and does not overwrite; a typo gets the nearest key."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from tests.support.cli import cli, error_line  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
SHORT = ["+exp=tiny_lora", "train.max_steps=4", "train.global_batch_size=4", "train.micro_batch_size=2",
         "data.seq_len=64", "eval.accuracy=false", "eval.iters=1"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run = tmp_path_factory.mktemp("trained") / "run"
    return run, cli("train", *SHORT, "eval.interval=2", f"run.dir={run}")


def test_train_prints_run_dir_and_a_summary_whose_generate_command_works(trained, tmp_path):
    run, proc = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr.splitlines()
    first = next(i for i, ln in enumerate(err) if "run directory:" in ln)
    assert err[first].endswith(f"run directory: {run}")
    assert first < next(
        i for i, ln in enumerate(err) if "step 1/" in ln or "step=1" in ln or " 1/4" in ln
    )
    text = "\n".join(err[first + 1 :])
    assert f"done: 4 steps; run directory {run}" in text
    assert "final training loss" in text
    assert "validation loss: final" in text and "best" in text
    assert f"checkpoints: {run / 'checkpoints'}" in text
    assert f"adapter (PEFT): {run / 'hf_adapter'}" in text
    assert proc.stdout == ""
    # quiet by default: megatron's import-time UserWarnings (no Apex/TE on CPU) stay out
    assert "UserWarning" not in proc.stderr and "Apex is not installed" not in proc.stderr
    # the printed command, as a user pastes it (with a prompt of their own), generates; with
    # --verbose the libraries' warnings come through (quiet: the training run above)
    cmd = next(ln for ln in err if "generate with:" in ln).split("generate with: ", 1)[1]
    argv = shlex.split(cmd.replace("...", "2 + 3 ="))
    assert argv[:3] == ["python", "-m", "ftcore.generate"], argv
    gen = cli("generate", *argv[3:], "generate.max_new_tokens=2", "--verbose", cwd=tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "UserWarning" in gen.stderr  # --verbose lets the libraries' warnings through
    assert not (tmp_path / "outputs").exists()  # generate writes nothing: no run directory


def test_eval_does_not_scatter_run_dirs(tmp_path):
    """eval keeps its results under outputs/<exp>/eval, apart from the training runs. (generate
    writes nothing at all: the summary test above, run from an empty directory too.)"""
    ev = cli("eval", "+exp=tiny_lora", "data.seq_len=64", "eval.accuracy=false", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr[-3000:]
    assert "UserWarning" not in ev.stderr
    # the data it evaluates is what its format line names (the bundled validation file, not the
    # preset's training file), and it trains nothing: no trainable-parameter count (issue 52)
    assert "data.format=auto: " in ev.stderr and "val.jsonl: instruction" in ev.stderr, ev.stderr[
        -3000:
    ]
    assert "train.jsonl" not in ev.stderr and "trainable params" not in ev.stderr
    exp_dir = tmp_path / "outputs" / "tiny_lora"
    assert sorted(p.name for p in exp_dir.iterdir()) == ["eval"]  # nothing among training runs
    (run,) = (exp_dir / "eval").iterdir()
    assert sorted(p.name for p in run.iterdir()) == ["eval.json"]


def test_a_run_that_fails_in_setup_writes_nothing(tmp_path):
    run = tmp_path / "run"
    proc = cli("train", *SHORT, "model.vocab_size=64", f"run.dir={run}")
    assert "model.vocab_size" in error_line(proc)
    assert not run.exists()


def test_export_says_what_it_wrote_and_does_not_overwrite(trained):
    run, proc = trained
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = run / "hf_adapter" / "adapter_model.safetensors"
    before = adapter.stat().st_mtime_ns
    refused = cli("export", f"export.checkpoint={run}")
    line = error_line(refused)
    assert line.startswith(f"ftcore error: export.output: {run / 'hf_adapter'} already exists")
    assert "export.overwrite=true" in line
    assert adapter.stat().st_mtime_ns == before  # untouched
    done = cli("export", f"export.checkpoint={run}", "export.overwrite=true")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"wrote the PEFT adapter of {run / 'checkpoints'}" in done.stderr
    assert done.stderr.rstrip().endswith(str(run / "hf_adapter"))
    assert adapter.stat().st_mtime_ns != before


@pytest.mark.parametrize(
    "typo, key, nearest",
    [
        ("peft.rank=4", "peft.rank", "peft.r"),
        ("train.max_step=4", "train.max_step", "train.max_steps"),
        ("pef.r=4", "pef", "peft"),
    ],
)
def test_a_typo_gets_the_nearest_key(typo, key, nearest):
    line = error_line(cli("train", "+exp=tiny_lora", typo))
    assert line.startswith(f"ftcore error: {key}: "), line
    assert f"(did you mean {nearest}?)" in line, line


def test_info_prints_what_hydra_prints():
    proc = cli("train", "+exp=tiny_lora", "--info", "defaults")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Defaults List" in proc.stdout and "exp/tiny_lora" in proc.stdout
    proc = cli("generate", "--info")  # no argument: Hydra's `all`
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("Hydra ") and "Config search path" in proc.stdout


@pytest.mark.dist
def test_an_error_found_by_two_workers_is_printed_once_as_the_last_line(tmp_path):
    from tests.support.tiny import TINY

    run = tmp_path / "run"  # the tokenizer check runs in the workers, after the launch
    proc = cli("train", *TINY, "launcher.nproc_per_node=2", "model.vocab_size=64", f"run.dir={run}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.count("ftcore error:") == 1, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ftcore error: model.vocab_size: the tokenizer has"), last
    assert not run.exists()
