"""Issue 51: the one door's own promises (ftcore/runtime/safe_files/), and the attacks on model and
adapter directories: an index `weight_map` naming an absolute path (or `..`, or a link out) is
refused, while a Hugging Face cache snapshot (links into its repository's blobs/) reads; a
5,000-digit number in adapter_config.json is exit 2, not a crash; writes never follow a link; a
run config is data (no alias, no interpolation, the schema's keys and types)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ftcore.errors import FtcoreError
from ftcore.runtime import safe_files


def _model_dir(d: Path, names=("a", "b")) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(names):
        save_file({n: torch.full((2, 2), float(i))}, str(d / f"part-{i}.safetensors"))
    index = {"weight_map": {n: f"part-{i}.safetensors" for i, n in enumerate(names)}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def test_inside_keeps_names_inside(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    (root / "f").write_text("x")
    (tmp_path / "secret").write_text("s")
    (root / "in").symlink_to(root / "f")
    (root / "out").symlink_to(tmp_path / "secret")
    assert safe_files.inside(root, "f", "model.hf_path") == root / "f"
    assert safe_files.inside(root, "in", "model.hf_path") == root / "in"  # a link staying inside
    for bad in (str(tmp_path / "secret"), "../secret", "sub/../../secret", "out", ""):
        with pytest.raises(FtcoreError, match=r"model\.hf_path: .*outside"):
            safe_files.inside(root, bad, "model.hf_path")
    with pytest.raises(FtcoreError, match="outside"):
        safe_files.read_bytes(root / "out", "model.hf_path", root=root)


@pytest.mark.parametrize("how", ["absolute", "dotdot", "link"])
def test_an_index_naming_a_file_elsewhere_is_refused(tmp_path, how):
    """The attack: model.safetensors.index.json's weight_map named an absolute path elsewhere and
    those weights were loaded."""
    from ftcore.hf.io import SafetensorsDir

    other = _model_dir(tmp_path / "other")
    d = _model_dir(tmp_path / "model")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    if how == "absolute":
        index["weight_map"]["b"] = str(other / "part-1.safetensors")
    elif how == "dotdot":
        index["weight_map"]["b"] = "../other/part-1.safetensors"
    else:
        (d / "part-1.safetensors").unlink()
        (d / "part-1.safetensors").symlink_to(other / "part-1.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FtcoreError, match=r"model\.hf_path: .*index\.json names .*outside"):
        SafetensorsDir(d)


def test_a_hugging_face_cache_snapshot_reads(tmp_path):
    """A snapshot's files are links into ../../blobs of its repository folder: inside."""
    from ftcore.hf.io import SafetensorsDir
    from ftcore.hf.mappings import Piece

    src = _model_dir(tmp_path / "src")
    repo = tmp_path / "hub" / "models--org--tiny"
    snap = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in src.iterdir():
        (repo / "blobs" / f.name).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    st = SafetensorsDir(snap)
    assert torch.equal(st.read(Piece("b", None, None)), torch.ones(2, 2))


def test_adapter_config_parse_errors_are_exit_2(tmp_path):
    """A 5,000-digit number in adapter_config.json (Python's int limit, a ValueError that is not a
    JSONDecodeError) was a crash; it is an FtcoreError naming the file."""
    from ftcore.peft.config import read_adapter_config

    (tmp_path / "adapter_config.json").write_text('{"r": ' + "9" * 5000 + ', "lora_alpha": 16}')
    with pytest.raises(
        FtcoreError, match=r"peft\.adapter_path: .*adapter_config\.json is not valid JSON"
    ):
        read_adapter_config(str(tmp_path))
    (tmp_path / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(FtcoreError, match="not an object"):
        read_adapter_config(str(tmp_path))


def test_writes_never_follow_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").symlink_to(victim)
    (run / ".metrics.jsonl.tmp").symlink_to(victim)
    safe_files.write_atomic(run / "config.yaml", "a: 1\n")
    assert (run / "config.yaml").read_text() == "a: 1\n" and not (run / "config.yaml").is_symlink()
    (run / "metrics.jsonl").symlink_to(victim)
    with pytest.raises(FtcoreError, match=r"run\.dir: .*metrics\.jsonl is a symbolic link"):
        safe_files.open_append(run / "metrics.jsonl")
    assert victim.read_text() == "precious"
    with pytest.raises(FtcoreError, match=r"run\.dir: .*is a symbolic link"):
        safe_files.check_run_dir(run)


def test_a_run_config_is_data_checked_against_the_schema(tmp_path):
    from omegaconf import OmegaConf

    from ftcore.config.groups import FtcoreConfig

    ok = safe_files.run_config("model:\n  num_layers: 3\n", "c.yaml", "export.checkpoint")
    assert ok.model.num_layers == 3
    ours = OmegaConf.to_yaml(OmegaConf.structured(FtcoreConfig))  # an earlier ftcore's, unresolved
    assert "${" in ours and safe_files.run_config(ours, "c.yaml", "x").run.seed == 1234
    bad = {
        "alias": "a: &x [1]\nb: *x\n",
        "unknown key": "model:\n  no_such_key: 1\n",
        "wrong type": "model:\n  num_layers: many\n",
        "interpolation": "run:\n  exp: ${oc.env:HOME}\n",
        "node interpolation": "run:\n  exp: ${model.name}\n",
        "not a mapping": "- 1\n",
        "python tag": "run: !!python/object/apply:os.system [echo]\n",
    }
    for what, text in bad.items():
        with pytest.raises(FtcoreError, match=r"export\.checkpoint: c\.yaml"):
            safe_files.run_config(text, "c.yaml", "export.checkpoint")
        assert what


def test_a_tokenizer_directory_with_a_link_out_is_refused(tmp_path):
    from ftcore.data.tokenizer import bundled_tokenizer_dir, from_directory

    d = tmp_path / "tok"
    d.mkdir()
    for f in bundled_tokenizer_dir().iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    (tmp_path / "secret.json").write_text("{}")
    os.unlink(d / "tokenizer.json")
    (d / "tokenizer.json").symlink_to(tmp_path / "secret.json")
    with pytest.raises(
        FtcoreError, match=r"model\.tokenizer: .*holds a link that names 'tokenizer\.json'"
    ):
        from_directory(d)
