"""`python -m ftcore.export` (one process) from checkpoints of other layouts gives back the HF
tensors bit for bit; `python -m ftcore.eval` launches its own workers like train and matches HF's
loss; bad HF input during a real load exits 2 naming the file and the tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.hf_helpers import (
    VOCAB,
    cli_status,
    eval_case,
    hf_model,
    hf_text_loss,
    make_tiny_hf,
    read_hf_dir,
    save_case,
    tokens,
    write_text_data,
)

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "FTCORE_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    path = make_tiny_hf(tmp_path_factory.mktemp("hf") / "tied", tie=True, seed=3)
    x = tokens(seed=5)
    with torch.no_grad():
        logits = hf_model(path)(input_ids=x).logits.float()
    return {"path": str(path), "x": x, "logits": logits}


def _export(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ftcore.export", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


@pytest.mark.dist
def test_export_from_tp2_pp2_vp2_checkpoint_of_tied_model(pool4, tied, tmp_path):
    """Tied embeddings under PP (the last stage's output layer is loaded from embed_tokens),
    interleaving (two chunks per rank), TP vocab padding in the checkpoint: all undone by export."""
    layout = ["parallel.tp=2", "parallel.pp=2", "parallel.vp=2"]
    results = pool4.run(save_case, tied["path"], str(tmp_path), layout, tied["x"])
    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert logits
    for got in logits:
        rel = ((got - tied["logits"]).abs().max() / tied["logits"].abs().max()).item()
        assert rel <= 1e-5, f"tied tp2 x pp2 x vp2 logits differ by {rel:.2e}"
    out = tmp_path / "exported"
    proc = _export(
        [f"export.checkpoint={tmp_path}", f"export.output={out}", "export.max_shard_gb=0.0002"]
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # several shards + index
    ref = {k: v for k, v in hf_model(tied["path"]).state_dict().items() if k != "lm_head.weight"}
    got = read_hf_dir(out)
    assert set(got) == set(ref), set(got) ^ set(ref)
    for k, t in ref.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and config["vocab_size"] == VOCAB
    back = hf_model(out)
    with torch.no_grad():
        assert torch.equal(back(input_ids=tied["x"]).logits, tied["logits"])


@pytest.mark.dist
def test_export_cli_errors(tmp_path):
    proc = _export([f"export.checkpoint={tmp_path / 'nothing'}"])
    assert (
        proc.returncode == 2
        and "export.checkpoint" in proc.stderr
        and "Traceback" not in proc.stderr
    )


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfp")
    path = make_tiny_hf(root / "llama", seed=7, max_shard_size="100KB")
    data = write_text_data(root / "text.jsonl", n=9, seed=2)
    return {"path": path, "data": data, "loss": hf_text_loss(path, data)}


@pytest.mark.dist
def test_eval_cli_launches_workers(plain, tmp_path):
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ftcore.eval", "+exp=tiny_full", f"model.hf_path={plain['path']}",
         f"data.path={plain['data']}", "data.format=text", "data.seq_len=32", "train.global_batch_size=4",
         "train.micro_batch_size=2", "launcher.nproc_per_node=2", "parallel.tp=2", f"run.dir={tmp_path}",
         f"eval.output={out}", "logger.progress=lines"],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got) == {"loss", "tokens", "ppl"}
    assert got["tokens"] == plain["loss"]["tokens"]
    assert abs(got["loss"] - plain["loss"]["loss"]) <= 1e-5 * plain["loss"]["loss"]


def _corrupt(src: Path, dst: Path, how: str) -> tuple[str, list[str]]:
    """A copy of the HF dir with one shard damaged; (file, the tensors it holds)."""
    import shutil

    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    tensor = "model.layers.1.self_attn.k_proj.weight"
    f = dst / index[tensor]
    if how == "missing":
        f.unlink()
    elif how == "truncated":
        f.write_bytes(f.read_bytes()[:-100])
    elif how == "shape":
        from safetensors.torch import load_file, save_file

        ts = load_file(str(f))
        ts[tensor] = ts[tensor][:-1]
        save_file(ts, str(f), metadata={"format": "pt"})
    return f.name, [tensor] if how == "shape" else [k for k, v in index.items() if v == f.name]


@pytest.mark.dist
@pytest.mark.parametrize("how", ["missing", "truncated", "shape"])
def test_bad_shards_exit_2_naming_file_and_tensor(pool2, plain, tmp_path, how):
    name, tensors = _corrupt(plain["path"], tmp_path / "bad", how)
    argv = ["+exp=tiny_full", f"model.hf_path={tmp_path / 'bad'}", f"run.dir={tmp_path / 'run'}",
            "parallel.pp=2", "data.format=text", f"data.path={plain['data']}", "data.seq_len=32"]  # fmt: skip
    for status, err in pool2.run(
        cli_status, "ftcore.eval", argv
    ):  # both stages, not just the owner
        assert status == 2, err
        assert name in err and any(t in err for t in tensors) and "Traceback" not in err, err


@pytest.mark.dist
def test_eval_accuracy_on_instruction_data(pool1, plain, tmp_path):
    """eval.accuracy=true adds greedy exact-match accuracy (ftcore.generate) to the loss."""
    (got,) = pool1.run(eval_case, str(plain["path"]), str(tmp_path),
                       ["data.format=instruction", "eval.accuracy=true", "eval.max_samples=4", "data.seq_len=64"])  # fmt: skip
    assert set(got) == {"loss", "tokens", "ppl", "accuracy"} and 0.0 <= got["accuracy"] <= 1.0
    assert json.loads((tmp_path / "eval.json").read_text()) == got
