"""The MoE model build (ftcore/models/moe.py): megatron's router set up per family routes as
transformers' own router does (norm_topk_prob on and off, Mixtral), and the meta-device dry build
of a MoE layout holds only this EP rank's experts, nothing off the device."""

from __future__ import annotations

import pytest
import torch

from ftcore.config.schema import compose
from ftcore.models import moe
from tests.support.moe import moe_config
from tests.unit.validation.test_moe_checks import MOE


def _hf_router(family: str, norm: bool, weight: torch.Tensor):
    """transformers' router module of the family with the given weight."""
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter as Router

        config = moe_config("mixtral")
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter as Router

        config = moe_config("qwen3_moe", norm_topk_prob=norm)
    router = Router(config).eval()
    with torch.no_grad():
        router.weight.copy_(weight)
    return router


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen3_moe", False),
                                         ("mixtral", True)])  # fmt: skip
def test_router_routes_as_transformers(family, norm):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    over = ["model.moe_dense_layers=[]"] if family == "mixtral" else []
    cfg = compose(MOE + over + [f"model.family={family}", f"model.moe_norm_topk_prob={norm}"])
    kw = moe.transformer_kwargs(cfg, on_cpu=True)
    g = torch.Generator().manual_seed(3)
    weight, x = torch.randn(4, 64, generator=g), torch.randn(50, 64, generator=g)
    logits = x @ weight.T
    probs, routing = topk_routing_with_score_function(
        logits, kw["moe_router_topk"], use_pre_softmax=kw["moe_router_pre_softmax"],
        score_function=kw["moe_router_score_function"],
    )  # fmt: skip
    with torch.no_grad():
        _, scores, indices = _hf_router(family, norm, weight)(x)
    want = torch.zeros_like(probs).scatter(1, indices, scores.to(probs.dtype))
    assert torch.equal(routing, want > 0)
    torch.testing.assert_close(probs, want, rtol=1e-6, atol=1e-7)


def test_layer_pattern_and_dense_section():
    cfg = compose(MOE)
    assert moe.layer_pattern(cfg.model) == [1, 0, 1, 1]
    kw = moe.transformer_kwargs(cfg, on_cpu=True)
    assert kw["moe_layer_freq"] == [1, 0, 1, 1] and not kw["moe_grouped_gemm"]
    assert kw["moe_expert_capacity_factor"] is None  # dropless
    assert moe.transformer_kwargs(compose(["model.num_experts=null"]), on_cpu=True) == {}


def test_dry_build_holds_this_ep_rank_experts():
    """ep=2 x pp=2 on 4 meta GPUs: every stage on the device (the dispatcher's host-side index
    tensors aside), each sparse layer holding 2 of the 4 experts."""
    from ftcore.training import dry_build

    cfg = compose(MOE + ["parallel.ep=2", "parallel.pp=2", "cluster=h100", "cluster.num_gpus=4",
                         "model.allow_random_base=true"])  # fmt: skip
    for pp_rank, sparse in ((0, 1), (1, 2)):  # layer 1 (stage 0) is dense
        with dry_build.fake_world(cfg, 4, pp_rank), dry_build.cpu.meta_device():
            with dry_build.cpu.device_mode():
                dry_build.model_parallel_cuda_manual_seed(0)
            chunks = dry_build.build_model(cfg, init=False)
        assert dry_build.off_device(chunks) == []
        experts = sum(p.numel() for n, p in chunks[0].named_parameters() if ".experts." in n)
        assert experts == sparse * 2 * 3 * 64 * 48
        routers = [n for n, _ in chunks[0].named_parameters() if n.endswith("router.weight")]
        assert len(routers) == sparse


def test_the_router_runs_without_te_where_the_cpu_runtime_is_off(monkeypatch):
    """Issue 50 item 2: megatron binds moe_utils.te_general_gemm only when TE imports, and its
    router's gating tests it: a NameError at the first forward on a GPU without TE, where the CPU
    runtime (which bound it) is off. Every MoE build binds it now."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe import moe_utils

    monkeypatch.delattr(moe_utils, "te_general_gemm", raising=False)  # a process without TE
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 64, generator=g), torch.randn(4, 64, generator=g)
    with pytest.raises(NameError):
        moe_utils.router_gating_linear(x, w, None, torch.float32)  # megatron as it is there
    moe.moe_layer_spec(compose(MOE), get_gpt_layer_local_spec(), on_cpu=True)  # GPU without TE
    torch.testing.assert_close(moe_utils.router_gating_linear(x, w, None, torch.float32), x @ w.T)


@pytest.mark.parametrize("precision", ["fp8_cs", "mxfp8", "bf16"])
def test_quantized_experts_get_the_router_padding_te_needs(monkeypatch, precision):
    """Issue 50 item 12: FP8/FP4 MoE never set megatron's router padding, so Transformer Engine's
    grouped experts padded and unpadded every layer's tokens per expert (correct, slower). TE's
    rule (TE 2.9, pytorch/module/fp8_padding.py, Fp8Padding.forward): each expert's row count is
    rounded up to 16 (32 under MXFP8), and input already so aligned is returned as it is. With the
    padding on, megatron's dispatcher (moe_utils.pad_routing_map, at megatron's own alignment for
    the recipe) hands every expert such a count."""
    from megatron.core.enums import Fp8Recipe
    from megatron.core.fp8_utils import get_fp8_align_size
    from megatron.core.transformer.moe.moe_utils import pad_routing_map

    from ftcore.precision import recipes

    monkeypatch.setattr(recipes, "use_te", lambda cfg: True)  # a GPU with TE (none here)
    cfg = compose(MOE + [f"precision={precision}"])
    name = recipes.recipe_name(cfg)
    assert moe.transformer_kwargs(cfg, on_cpu=False)["moe_router_padding_for_quantization"] == (
        name is not None
    )
    assert not moe.transformer_kwargs(cfg, on_cpu=True)["moe_router_padding_for_quantization"]
    if name is None:
        return
    te_align = 32 if name == "mxfp8" else 16  # Fp8Padding's own choice
    g = torch.Generator().manual_seed(0)
    routing = torch.zeros(300, 4, dtype=torch.bool)
    routing.scatter_(1, torch.rand(300, 4, generator=g).topk(2, dim=1).indices, True)
    counts = pad_routing_map(routing.clone(), get_fp8_align_size(Fp8Recipe(name))).sum(0).tolist()
    assert [(m + te_align - 1) // te_align * te_align for m in counts] == counts, counts
    assert sum(counts) > 600  # it did pad: 300 tokens x top-2 over 4 experts


def test_expert_lora_keeps_te_with_one_module_per_expert(monkeypatch):
    """Issue 50 item 13: the two Qwen3-MoE LoRA experiments set precision.te_layers=false so that
    expert adapters had per-expert modules, which left TE for the whole model (attention on
    ftcore's SDPA and CP path, priced as TE's). Now a GPU with TE builds megatron's TE spec with
    SequentialMLP experts (moe_grouped_gemm off: one TE linear per expert, megatron's
    TESpecProvider.grouped_mlp_modules) when the experts are targeted, grouped experts otherwise;
    TE's fused permutation either way."""
    from megatron.core.models.gpt import gpt_layer_specs

    from ftcore.precision import recipes

    monkeypatch.setattr(recipes, "use_te", lambda cfg: True)  # a GPU with TE (none here)
    asked = []
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec",
                        lambda **kw: asked.append(kw) or "TE spec")  # fmt: skip
    for targets, grouped in (("[q_proj,gate_proj,up_proj,down_proj]", False), ("[q_proj]", True)):
        cfg = compose(MOE + ["peft=lora", f"peft.target_modules={targets}"])
        kw = moe.transformer_kwargs(cfg, on_cpu=False)
        assert kw["moe_grouped_gemm"] is grouped and kw["moe_permute_fusion"], targets
        assert moe.moe_layer_spec(cfg, None, on_cpu=False) == "TE spec"
        assert asked[-1]["moe_grouped_gemm"] is grouped
    for exp in ("qwen3_30b_a3b_lora", "qwen3_235b_a22b_lora"):
        cfg = compose([f"+exp={exp}"])
        assert cfg.precision.te_layers and moe.expert_adapters(cfg), exp
        assert not moe.transformer_kwargs(cfg, on_cpu=False)["moe_grouped_gemm"]
