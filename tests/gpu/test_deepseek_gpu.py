"""DeepSeek-V3 and GLM-4.5 on Transformer Engine's spec (docs/deepseek.md): TE's MLA (the latent
norms fused into the up projections, duplicated down projections, attention with separate key and
value widths) evaluates the tiny checkpoints of tests/support/deepseek.py to transformers' loss.
NOT RUN on the CPU machines this was written on: TE and a GPU are needed (skipped otherwise)."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import need_gpus, need_te, run_case
from tests.support.deepseek import make_tiny
from tests.support.hf_helpers import SEQ, hf_text_loss, write_text_data

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_te_spec_evaluates_to_transformers_loss(tmp_path, family):
    need_te()
    need_gpus(1)
    path = make_tiny(tmp_path / family, family, seed=11)
    data = write_text_data(tmp_path / "data.jsonl", n=7, seed=4)
    want = hf_text_loss(path, data)["loss"]
    got = run_case(tmp_path, "fp32_te_mla", f"model.hf_path={path}", f"data.path={data}",
                   "data.format=text", f"data.seq_len={SEQ}", mode="eval")  # fmt: skip
    # fp32 on TE: its GEMMs may take TF32 on Hopper (10-bit mantissa), hence 1e-3, not 1e-5
    assert abs(got["eval"]["loss"] - want) / want < 1e-3, (got["eval"], want)
