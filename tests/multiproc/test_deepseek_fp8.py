"""FP8 block-scaled checkpoints as DeepSeek publishes them (docs/deepseek.md, ftcore/hf/fp8.py).

The tiny DeepSeek-V3 (tests/support/deepseek.py) written in the published format: float8_e4m3fn
weights with a float32 `weight_scale_inv` per 8 x 8 block (the tiny shapes' stand-in for 128 x
128; the code reads any weight_block_size), `quantization_config` in config.json, its MTP layer
quantized too. The oracle is transformers, which dequantizes that format itself on a CPU
(q.float() * scale in fp32, then the model's dtype): ftcore at ep=2 x tp=2 evaluates to its loss
and logits to 1e-5, the tolerance of every eval parity here, since ftcore's dequantization is the
same fp32 product of the same numbers (bit-identical weights; the 1e-5 is the layouts' summation
order, as in tests/multiproc/test_deepseek_families.py). Each rank reads only its slices: the
rows (columns) of a TP-split weight and the scale blocks that cover them, its own experts.
The live export at the same layout writes bf16-or-own-dtype by default (no scales, MTP
dequantized) and the published FP8 format with export.dtype=fp8; transformers loads both as the
same model (the FP8 one re-quantized from the dequantized weights: 1e-5 again, each block's
scale recomputed to within an ulp and the same e4m3 values).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.deepseek import make_tiny, to_fp8
from tests.support.hf_helpers import (
    check_against_hf,
    hf_model,
    hf_text_loss,
    read_hf_dir,
    rel_error,
    tokens,
    write_text_data,
)

RTOL = 1e-5
LAYOUT = ["parallel.ep=2", "parallel.tp=2"]


def fp8_case(hf_dir: str, run_dir: str, x: torch.Tensor, data: str) -> dict:
    """Worker: ftcore.eval's run at ep=2 x tp=2 from the FP8 directory (its logits and
    evaluation), the pieces of FP8 tensors this rank read, and the live export in both formats."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftcore.eval import evaluate
    from ftcore.hf.export import write_hf_model
    from ftcore.hf.io import SafetensorsDir
    from ftcore.training import trainer
    from tests.support.hf_helpers import compose_hf, forward_logits

    raw, reads = SafetensorsDir._read, []

    def recording(self, piece):
        t = raw(self, piece)
        if t.dtype == torch.float8_e4m3fn or piece.hf.endswith("_scale_inv"):
            reads.append((piece.hf, piece.rows, piece.cols))
        return t

    SafetensorsDir._read = recording
    try:
        cfg = compose_hf(hf_dir, run_dir, LAYOUT + [f"data.path={data}"])
        state = trainer.setup(cfg, data=False, kind="eval")
    finally:
        SafetensorsDir._read = raw
    logits = forward_logits(state, x)
    out = {"logits": logits if ps.get_tensor_model_parallel_rank() == 0 else None,
           "rank": dist.get_rank(), "eval": evaluate(state.cfg, state), "reads": reads,
           "tp_rank": ps.get_tensor_model_parallel_rank(),
           "ep_rank": ps.get_expert_model_parallel_rank()}  # fmt: skip
    out["plain"] = str(write_hf_model(state, out=Path(run_dir) / "plain"))
    state.cfg.export.dtype = "fp8"
    out["fp8"] = str(write_hf_model(state, out=Path(run_dir) / "fp8"))
    return out


@pytest.mark.dist
def test_fp8_checkpoint_reads_slices_and_exports(pool4, tmp_path):
    src = make_tiny(tmp_path / "src", "deepseek_v3", seed=11, with_mtp=True)
    path = to_fp8(src, tmp_path / "fp8")
    data = write_text_data(tmp_path / "data.jsonl", n=7, seed=4)
    x = tokens(seed=6)
    with torch.no_grad():
        logits = hf_model(path)(input_ids=x).logits.float()  # transformers dequantizes on CPU
        full = hf_model(src)(input_ids=x).logits.float()
    assert rel_error(logits, full) > 1e-3, "the FP8 rounding changed nothing: nothing is tested"
    ref = {"logits": logits, "loss": hf_text_loss(path, data)}
    res = pool4.run(fp8_case, str(path), str(tmp_path / "run"), x, str(data))
    check_against_hf(res, ref, "FP8 checkpoint at ep2 x tp2", RTOL)

    for r in res:  # only this rank's rows/columns of an FP8 weight, and the blocks covering them
        t, e = r["tp_rank"], r["ep_rank"]
        got = {(name, rows, cols) for name, rows, cols in r["reads"]}
        q_b = "model.layers.1.self_attn.q_b_proj.weight"
        assert {(rows, cols) for n, rows, cols in got if n == q_b} == {
            ((48 * t, 48 * t + 48), None)
        }
        assert {(rows, cols) for n, rows, cols in got if n == q_b + "_scale_inv"} == {
            ((6 * t, 6 * t + 6), (0, 6))}  # fmt: skip
        o = "model.layers.2.self_attn.o_proj.weight"
        assert {(rows, cols) for n, rows, cols in got if n == o} == {
            ((0, 64), (32 * t, 32 * t + 32))
        }
        experts = {
            int(n.split(".experts.")[1].split(".")[0]) for n, _, _ in got if ".experts." in n
        }
        assert experts == set(range(4 * e, 4 * e + 4)), (e, experts)

    plain, fp8 = read_hf_dir(res[0]["plain"]), read_hf_dir(res[0]["fp8"])
    assert not any(k.endswith("_scale_inv") for k in plain)  # dequantized, the MTP layer too
    assert plain["model.layers.4.self_attn.o_proj.weight"].dtype == torch.float32  # precision=fp32
    source = read_hf_dir(path)
    assert set(fp8) == set(source)  # the published format: FP8 weights and scales, bf16, the bias
    for k, t in source.items():
        assert fp8[k].dtype == t.dtype, k
        if not k.startswith("model.layers.4."):  # the MTP layer: copied as stored
            continue
        assert torch.equal(
            fp8[k].view(torch.uint8) if t.element_size() == 1 else fp8[k],
            t.view(torch.uint8) if t.element_size() == 1 else t,
        ), k
    for out in (res[0]["plain"], res[0]["fp8"]):
        with torch.no_grad():
            back = hf_model(out)(input_ids=x).logits.float()
        assert rel_error(back, logits) <= RTOL, (out, rel_error(back, logits))
