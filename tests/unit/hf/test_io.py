"""safetensors in and out: the streaming writer's files load in safetensors and transformers, and
bad shards (missing, truncated, wrong shape, absent tensor) are FtcoreErrors naming file and tensor."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ftcore.errors import FtcoreError
from ftcore.hf.io import SafetensorsDir, StreamWriter
from ftcore.hf.mappings import Piece


def test_stream_writer_any_order(tmp_path):
    ts = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6.0).reshape(2, 3),
    }
    w = StreamWriter(
        tmp_path / "x.safetensors", [(k, t.dtype, tuple(t.shape)) for k, t in ts.items()]
    )
    for k in ("c", "a", "b"):
        w.add(k, ts[k])
    w.close()
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        for k, t in ts.items():
            assert torch.equal(f.get_tensor(k), t)


def test_stream_writer_refuses_incomplete(tmp_path):
    w = StreamWriter(
        tmp_path / "x.safetensors", [("a", torch.float32, (2,)), ("b", torch.float32, (2,))]
    )
    w.add("a", torch.ones(2))
    with pytest.raises(RuntimeError, match="never written: b"):
        w.close()
    assert not (tmp_path / "x.safetensors").exists()


@pytest.fixture
def shards(tmp_path):
    save_file({"w": torch.arange(12.0).reshape(4, 3)}, str(tmp_path / "a.safetensors"))
    save_file({"v": torch.arange(5.0)}, str(tmp_path / "b.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "a.safetensors", "v": "b.safetensors"}})
    )
    return tmp_path


def test_reads_only_the_piece(shards):
    st = SafetensorsDir(shards)
    assert torch.equal(st.read(Piece("w", rows=(1, 3))), torch.arange(12.0).reshape(4, 3)[1:3])
    assert torch.equal(st.read(Piece("w", cols=(1, 2))), torch.arange(12.0).reshape(4, 3)[:, 1:2])
    assert torch.equal(st.read(Piece("v", rows=(2, 5))), torch.arange(2.0, 5.0))


def test_missing_shard_names_file_and_tensor(shards):
    (shards / "b.safetensors").unlink()
    with pytest.raises(FtcoreError) as e:
        SafetensorsDir(shards).read(Piece("v"))
    assert (
        "b.safetensors" in str(e.value)
        and "holding v" in str(e.value)
        and "missing" in str(e.value)
    )


def test_truncated_shard_names_file_and_tensor(shards):
    f = shards / "a.safetensors"
    f.write_bytes(f.read_bytes()[:-8])
    with pytest.raises(FtcoreError, match="truncated") as e:
        SafetensorsDir(shards).check_shape("w", (4, 3))
    assert "a.safetensors" in str(e.value) and "holding w" in str(e.value)
    f.write_bytes(b"\x01\x02")
    with pytest.raises(FtcoreError, match="not a readable safetensors file"):
        SafetensorsDir(shards).read(Piece("w"))


def test_shape_mismatch_and_absent_tensor(shards):
    st = SafetensorsDir(shards)
    with pytest.raises(
        FtcoreError,
        match=r"a.safetensors: tensor w has shape \(4, 3\), the config implies \(4, 4\)",
    ):
        st.check_shape("w", (4, 4))
    with pytest.raises(FtcoreError, match="tensor q is not in"):
        st.check_shape("q", (1,))


def test_directory_without_index(tmp_path):
    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    assert torch.equal(SafetensorsDir(tmp_path).read(Piece("w")), torch.ones(2))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FtcoreError, match="holds no"):
        SafetensorsDir(tmp_path / "empty")


def test_lying_header_length_is_refused_before_it_is_read(shards):
    """Issue 46: a header length over safetensors' 100 MB bound is refused without allocating it,
    even when the (sparse) file is long enough to hold it."""
    import struct
    import tracemalloc

    f = shards / "a.safetensors"
    with open(f, "wb") as fh:
        fh.write(struct.pack("<Q", 300_000_000))
        fh.truncate(400_000_000)  # sparse: no disk used
    tracemalloc.start()
    try:
        with pytest.raises(FtcoreError, match="over safetensors' 100000000-byte limit") as e:
            SafetensorsDir(shards).read(Piece("w"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "a.safetensors" in str(e.value) and peak < 10 << 20, peak
    f.write_bytes(struct.pack("<Q", 2) + b"[]")  # a header that is not an object: exit 2 too
    with pytest.raises(FtcoreError, match="not a readable safetensors file"):
        SafetensorsDir(shards).read(Piece("w"))
