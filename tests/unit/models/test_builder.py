"""What the model build creates and where (issue 24, findings 2, 4 and 5).

On GPU nothing moves a parameter after the build unless the distributed optimizer's buffer does, so
an adapter created on the CPU meets a CUDA base in the first forward. The CPU stand-in for "another
device" is `meta`: the base is moved there and every parameter and buffer the adapters add must
follow it, in the model's dtype. And no high-precision host copy of an FP8 weight (Transformer
Engine keeps one per weight when megatron asks) survives the build. A large random-init
run draws each rank's shard on its device, never the full tensor (models/init.py).
"""

from __future__ import annotations

import pytest
import torch

from ftcore.config.schema import compose
from tests.support.tiny import TINY

TARGETS = "peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]"


@pytest.fixture(scope="module")
def runtime():
    """One rank: gloo, ftcore's CPU runtime and megatron's parallel state (TP=PP=1)."""
    from megatron.core import tensor_parallel

    from ftcore.runtime import cpu
    from ftcore.runtime import dist as rdist

    cfg = compose([*TINY, "launcher.threads_per_rank=1"])
    rdist.init_distributed(cfg)
    cpu.activate()
    rdist.init_model_parallel(cfg, 1)
    with cpu.device_mode():
        tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    rdist.teardown()


def _cfg(*overrides):
    return compose([*TINY, "precision.params_dtype=bf16", *overrides])


def _off(chunks, device: str, dtype: torch.dtype) -> list[str]:
    """Names of parameters/buffers not on `device`, and floating ones not in `dtype`."""
    bad = []
    for chunk in chunks:
        for name, t in [*chunk.named_parameters(), *chunk.named_buffers()]:
            if t.device.type != device or (t.is_floating_point() and t.dtype != dtype):
                bad.append(f"{name} ({t.device}, {t.dtype})")
    return bad


@pytest.mark.parametrize("peft", ["lora", "qlora"])
def test_adapters_are_created_on_the_base_layers_device_and_dtype(runtime, peft):
    from ftcore.models.builder import build_model
    from ftcore.peft.lora import apply_peft, lora_modules

    cfg = _cfg(f"peft={peft}", TARGETS)
    chunks = [c.to("meta") for c in build_model(cfg)]
    assert _off(chunks, "meta", torch.bfloat16) == []  # the base, before any adapter
    apply_peft(cfg, chunks)
    assert _off(chunks, "meta", torch.bfloat16) == []
    adapted = list(lora_modules(chunks))
    assert len(adapted) == 4 * cfg.model.num_layers  # every target got its adapters
    for _, _, m in adapted:
        assert m.lora_A and m.lora_B


class TELikeLinear(torch.nn.Module):
    """What Transformer Engine does when it creates an FP8 weight (module/base.py
    reset_parameters): with the preserve flag, which megatron sets to torch.is_grad_enabled(), it
    attaches the weight's high-precision value and two accessors, then registers the weight."""

    made: list = []

    def __init__(self, n: int = 8):
        super().__init__()
        self.grad_mode = torch.is_grad_enabled()  # TE sets the column-wise usage from it too
        # copies still held by the weights made before this one
        self.live_before = sum(hasattr(m.weight, "_high_precision_init_val") for m in self.made)
        param = torch.nn.Parameter(torch.empty(n, n))
        if self.grad_mode:
            from types import MethodType

            def get(self):
                return getattr(self, "_high_precision_init_val", None)

            def clear(self):
                if hasattr(self, "_high_precision_init_val"):
                    del self._high_precision_init_val

            param._high_precision_init_val = param.detach().cpu()
            param.get_high_precision_init_val = MethodType(get, param)
            param.clear_high_precision_init_val = MethodType(clear, param)
        self.weight = param
        self.made.append(self)


def test_no_high_precision_copy_survives_the_build(runtime, monkeypatch):
    """Weights made the way TE makes FP8 weights inside megatron's GPTModel: none keeps its copy
    (nor the accessor megatron's distributed optimizer reads), at most one exists at a time, and
    the build keeps megatron's grad mode (TE derives the weights' column-wise usage from it)."""
    from megatron.core.models.gpt import GPTModel

    from ftcore.models import builder

    class GPTWithTEWeights(GPTModel):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.te_like = torch.nn.ModuleList(TELikeLinear() for _ in range(3))

    TELikeLinear.made.clear()
    monkeypatch.setattr(builder, "GPTModel", GPTWithTEWeights)
    chunks = builder.build_model(_cfg())
    made = TELikeLinear.made
    assert len(made) == 3 * len(chunks) and all(m.grad_mode for m in made)
    assert max(m.live_before for m in made) == 0
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            assert not hasattr(p, "_high_precision_init_val"), name
            assert not hasattr(p, "get_high_precision_init_val"), name


# ------------------------------------------------------------------ random init (finding 5)

INIT = dict(seed=7, std=0.02, num_layers=4)


def _largest_tensor_made(fn) -> int:
    """The most elements of any tensor an op creates while fn runs (torch's dispatch mode)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    Largest.most = max(Largest.most, t.numel())
            return out

    with Largest():
        fn()
    return Largest.most


def _params(chunks):
    from ftcore.models.sharding import iter_params

    return dict(iter_params(chunks))


def test_sharded_init_never_makes_a_full_tensor(runtime):
    """Each parameter taken as rank 1's shard of a TP=2 model: the sharded init creates nothing
    bigger than the largest shard; the layout-independent one draws the full (2x) tensors."""
    from ftcore.models import init
    from ftcore.models.builder import build_model

    chunks = build_model(_cfg())
    largest = max(p.numel() for p in _params(chunks).values())
    args = dict(INIT, vocab_size=4000, tp=2, tp_rank=1)
    assert _largest_tensor_made(lambda: init.init_shards(chunks, **args)) <= largest
    assert _largest_tensor_made(lambda: init.init_weights(chunks, **args)) == 2 * largest


def test_sharded_init_draws_megatrons_distributions(runtime):
    from ftcore.models import init
    from ftcore.models.builder import build_model

    cfg = _cfg("precision.params_dtype=fp32")
    chunks = build_model(cfg)
    vocab, layers = 3000, INIT["num_layers"]
    init.init_shards(chunks, **INIT, vocab_size=vocab, tp=2, tp_rank=1)  # global rows 2048..4095
    params = _params(chunks)
    for name, p in params.items():
        if "norm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
            continue
        want = (
            0.02 / (2 * layers) ** 0.5 if ("linear_proj" in name or "linear_fc2" in name) else 0.02
        )
        real = p[: vocab - 2048] if ("word_embeddings" in name or "output_layer" in name) else p
        assert abs(real.std().item() / want - 1) < 0.05, name
        assert abs(real.mean().item()) < want / 10, name
    emb = params["embedding.word_embeddings.weight"]
    assert emb.shape[0] == 2048 and not emb[vocab - 2048 :].any()  # padded vocab rows stay zero
    assert emb[: vocab - 2048].ne(0).all()


def test_sharded_init_is_per_shard_and_repeatable(runtime):
    """Same (seed, name, TP rank): the same numbers (DP/CP replicas agree); another TP rank: others."""
    from ftcore.models import init
    from ftcore.models.builder import build_model

    chunks = build_model(_cfg())
    name = "decoder.layers.1.mlp.linear_fc1.weight"

    def draw(rank):
        init.init_shards(chunks, **INIT, vocab_size=2048, tp=2, tp_rank=rank)
        return _params(chunks)[name].clone()

    assert torch.equal(draw(0), draw(0))
    assert not torch.equal(draw(0), draw(1))


def test_init_method_defaults_keep_small_models_layout_independent():
    from ftcore.planner.params import init_method

    tiny, big = compose([*TINY]), compose(["+exp=8b_lora"])
    assert init_method(tiny, on_gpu=True) == "layout_independent"
    assert init_method(big, on_gpu=False) == "layout_independent"  # every CPU run
    assert init_method(big, on_gpu=True) == "sharded"
    big.model.init_method = "layout_independent"
    assert init_method(big, on_gpu=True) == "layout_independent"
    tiny.model.init_method = "sharded"
    assert init_method(tiny, on_gpu=False) == "sharded"


def test_build_uses_the_configured_init(runtime):
    from ftcore.models.builder import build_model

    name = "decoder.layers.0.self_attention.linear_qkv.weight"

    def built(method):
        return _params(build_model(_cfg(f"model.init_method={method}")))[name]

    sharded = built("sharded")
    assert torch.equal(sharded, built("sharded"))
    assert not torch.equal(sharded, built("layout_independent"))
    assert torch.equal(built("auto"), built("layout_independent"))  # tiny, CPU


def test_bad_init_method_is_a_config_error():
    from ftcore.errors import FtcoreError
    from ftcore.validation.checks import validate

    with pytest.raises(FtcoreError) as e:
        validate(compose([*TINY, "model.init_method=fast"]), 1)
    assert e.value.field == "model.init_method"
