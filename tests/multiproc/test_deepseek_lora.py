"""LoRA on DeepSeek-V3's latent attention and experts (docs/deepseek.md): two LoRA steps at ep=2
from the tiny DeepSeek-V3 of transformers (q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj,
o_proj; gate/up/down_proj on the routed experts, the shared expert and the dense first layer)
write `hf_adapter/`; PEFT loads it onto transformers' DeepseekV3ForCausalLM, and its LM loss is
the trained model's and `ftcore.eval`'s with `peft.adapter_path` at ep=2 (1e-5); the live merge
at ep=2 loads in transformers as the same model (merge included)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc.test_moe_lora import eval_case, hf_moe, text_loss
from tests.support.deepseek import make_tiny
from tests.support.hf_helpers import compose_hf, write_text_data

STEPS = 2
LORA = ["peft=lora", "peft.r=4", "peft.lora_alpha=8", "optim.lr=2e-2", "sched.warmup_steps=0",
        "peft.target_modules=[q_a_proj,q_b_proj,kv_a_proj_with_mqa,kv_b_proj,o_proj,gate_proj,"
        "up_proj,down_proj]"]  # fmt: skip


def train_case(hf_dir: str, run_dir: str, layout: list[str], data: str) -> dict:
    """Worker: a few LoRA steps, then hf_adapter/ and the live merge."""
    from megatron.core import parallel_state as ps

    from ftcore.eval import evaluate
    from ftcore.hf.export import write_hf_model
    from ftcore.peft.adapter_format import write_hf_adapter
    from ftcore.peft.lora import count_params
    from ftcore.peft.merge import live_merge_transform
    from ftcore.training import trainer
    from tests.support.layouts import SyntheticLoader

    cfg = compose_hf(hf_dir, run_dir, LORA + layout + [f"data.path={data}"])
    state = trainer.setup(cfg, data=False)
    counts = count_params(state.cfg, state.model)
    state.loader = SyntheticLoader(cfg, ps.get_data_parallel_rank(), state.dp, 2048)
    for _ in range(STEPS):
        trainer.train_step(state)
    adapter = write_hf_adapter(state)
    merged = write_hf_model(
        state, transform=live_merge_transform(state), out=Path(run_dir) / "merged"
    )
    return {"adapter": str(adapter) if adapter else None, "merged": str(merged),
            "eval": evaluate(state.cfg, state), "counts": counts}  # fmt: skip


def _close(got: float, want: float, what: str, rtol: float = 1e-5) -> None:
    rel = abs(got - want) / want
    assert rel <= rtol, f"{what}: {got} vs {want} (relative {rel:.1e})"


@pytest.mark.dist
def test_ep2_adapter_loads_in_peft(pool2, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoTokenizer

    base = str(make_tiny(tmp_path / "deepseek_v3", "deepseek_v3", seed=3))
    data = str(write_text_data(tmp_path / "data.jsonl", n=5, seed=2))
    trained = pool2.run(train_case, base, str(tmp_path / "run"), ["parallel.ep=2"], data)
    adapter = next(r["adapter"] for r in trained if r["adapter"])
    with safe_open(str(Path(adapter) / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
        numel = sum(torch.Size(f.get_slice(k).get_shape()).numel() for k in keys)
    for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj",
                 "layers.0.mlp.gate_proj", "shared_experts.down_proj", "experts.7.up_proj"):  # fmt: skip
        assert any(part in k for k in keys), f"no adapter on {part}"
    assert trained[0]["counts"][0] == numel  # every adapter counted once (experts over EP)
    tok = AutoTokenizer.from_pretrained(base)
    want = text_loss(PeftModel.from_pretrained(hf_moe(base), adapter).eval(), tok, data)
    plain = text_loss(hf_moe(base), tok, data)
    assert abs(plain - want) > 1e-3 * want, "the adapter changed nothing: the test proves nothing"
    _close(trained[0]["eval"]["loss"], want, "the trained model at ep=2 vs PEFT")
    got = pool2.run(eval_case, base, str(tmp_path / "eval"), ["parallel.ep=2"], data, adapter)
    _close(got[0]["loss"], want, "ftcore.eval with the adapter at ep=2 vs PEFT")
    _close(text_loss(hf_moe(trained[0]["merged"]), tok, data), want, "live merge at ep=2")
