"""Whole runs on one GPU: LoRA with the distributed optimizer off (adapters must be created on the
GPU, finding 2), LoRA on an FP8 base, QLoRA, an FP8 (fp8_param_gather) load of a HF checkpoint,
async save then resume, and a packed (THD) batch against the same documents unpacked."""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.conftest import need_runs, run_case

pytestmark = pytest.mark.gpu


def learns(losses: list[float]) -> bool:
    return all(math.isfinite(v) for v in losses) and sum(losses[-5:]) < sum(losses[:5])


@pytest.mark.parametrize("name", ["lora_local", "lora_te"])
def test_lora_with_the_distributed_optimizer_off(runs, name):
    need_runs(name)
    assert learns(runs(name)["losses"])


def test_lora_on_an_fp8_base_tracks_bf16_lora(runs):
    need_runs("lora_fp8_cs")
    got, ref = runs("lora_fp8_cs"), runs("lora_te")
    assert got["fp8"]["fp8_modules"] > 0 and learns(got["losses"])
    a, b = sum(got["losses"][-5:]) / 5, sum(ref["losses"][-5:]) / 5
    assert abs(a - b) <= 0.05 * b, (got["losses"], ref["losses"])


def test_qlora(runs):
    need_runs("qlora")
    pytest.importorskip("bitsandbytes", reason="NOT RUN: bitsandbytes is not installed")
    assert learns(runs("qlora")["losses"])


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random HF Llama with the tiny model's shapes, saved in BF16."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=704,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=1024, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         initializer_range=0.05)  # fmt: skip
    from transformers import AutoTokenizer

    from ftcore.data.tokenizer import bundled_tokenizer_dir

    d = tmp_path_factory.mktemp("hf") / "llama"
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(d)
    AutoTokenizer.from_pretrained(str(bundled_tokenizer_dir())).save_pretrained(d)
    return d


def test_fp8_param_gather_load_matches_the_bf16_load(runs, hf_dir):
    """FP8 weights written whole (finding 3): the logits of an FP8-stored load are those of the
    BF16 load to FP8 accuracy, and the BF16 load is HF's own forward."""
    need_runs("hf_fp8_param_gather")
    from transformers import LlamaForCausalLM

    hf = f"model.hf_path={hf_dir}"
    fp8 = runs("hf_fp8_param_gather", hf, mode="logits")
    bf16 = runs("hf_bf16", hf, mode="logits")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 2048, (2, 64), generator=g).cuda()
    model = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.bfloat16).cuda()
    with torch.no_grad():
        ref = model(tokens).logits.float().cpu()
    bf16 = bf16.transpose(0, 1) if bf16.shape[:2] != ref.shape[:2] else bf16  # [s, b] -> [b, s]
    fp8 = fp8.transpose(0, 1) if fp8.shape[:2] != ref.shape[:2] else fp8

    def rel(a, b):
        return ((a[..., :2048] - b).norm() / b.norm()).item()

    assert rel(bf16, ref) < 0.02, rel(bf16, ref)
    assert 0 < rel(fp8, bf16[..., :2048]) < 0.1, rel(fp8, bf16[..., :2048])


@pytest.mark.parametrize("name", ["ckpt", "ckpt_distopt", "ckpt_distopt_te"])
def test_async_save_then_resume_gives_bit_identical_losses(tmp_path, name):
    """10 steps straight, against a job that ends after step 5 (its async save at 5 published)
    and a second job that resumes from it to step 10 (and saves at 10): the same config, the same
    losses. With the distributed optimizer too, whose inner optimizer is TE's FusedAdam wherever
    TE is installed (issue 41, item 1: the resume used to fail there, and every save after it)."""
    need_runs(name)
    det = {"FTCORE_GPU_DETERMINISTIC": "1"}
    straight = run_case(tmp_path, name, run_dir=tmp_path / "a", env=det)["losses"]
    first = run_case(
        tmp_path, name, run_dir=tmp_path / "b", env={**det, "FTCORE_GPU_STOP_AFTER": "5"}
    )
    assert len(first["losses"]) == 5 and (tmp_path / "b" / "checkpoints").is_dir()
    resumed = run_case(tmp_path, name, run_dir=tmp_path / "b", env=det)["losses"]
    assert (tmp_path / "b" / "checkpoints" / "step_10").is_dir()  # the save after the resume
    assert len(straight) == 10 and resumed[-5:] == straight[5:], (straight, resumed)


@pytest.mark.parametrize("name,rtol", [("packed_local", 1e-2), ("packed_te", 1e-2)])
def test_packed_batch_equals_unpacked(runs, name, rtol):
    """The same documents, packed into THD rows and one per row: the same loss (BF16 kernels
    differ in summation order, hence 1 %) over the same target tokens."""
    need_runs(name)
    got = runs(name, mode="packing")
    p, u = got["packed"], got["unpacked"]
    assert p["targets"] == u["targets"] and p["rows"] < u["rows"], got
    assert abs(p["loss"] - u["loss"]) <= rtol * abs(u["loss"]), got
