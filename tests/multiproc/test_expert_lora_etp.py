"""An expert's adapters under expert tensor parallelism (peft/experts.py), on megatron's own expert
MLP at etp=2. ftcore refuses etp > 1 for whole runs on CPU (gloo lacks the dispatcher's uneven
all_gather), so this drives one expert directly, doing the dispatcher's part by hand: the same
tokens on both ranks in, the partial outputs summed out. Output and every adapter gradient equal
plain torch on the full tensors, (W + s*B*A) per projection."""

from __future__ import annotations

import pytest

H, FF, R, S, N = 16, 12, 2, 1.5, 5  # hidden, expert ffn, rank, scale, tokens


def _etp_case() -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    from ftcore.models.sharding import shard_info, take_shard
    from ftcore.peft.config import Geometry, plan_targets
    from ftcore.peft.experts import wrap_experts

    ps.initialize_model_parallel(expert_tensor_parallel_size=2)
    group, rank = ps.get_expert_tensor_parallel_group(), ps.get_expert_tensor_parallel_rank()
    config = TransformerConfig(
        num_layers=1, hidden_size=H, ffn_hidden_size=FF, num_attention_heads=4, num_moe_experts=2,
        moe_ffn_hidden_size=FF, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        expert_tensor_parallel_size=2, use_cpu_initialization=True, gradient_accumulation_fusion=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

    w1, w2, x, gout = rnd(2 * FF, H), rnd(H, FF), rnd(N, H), rnd(N, H)
    full = {"fc1.A.gate_proj": rnd(R, H), "fc1.A.up_proj": rnd(R, H), "fc1.B.gate_proj": rnd(FF, R),
            "fc1.B.up_proj": rnd(FF, R), "fc2.A.down_proj": rnd(R, FF), "fc2.B.down_proj": rnd(H, R)}  # fmt: skip
    # plain torch on full tensors: the reference
    ref = {k: t.clone().requires_grad_(True) for k, t in full.items()}
    d = {s: S * ref[f"fc1.B.{s}"] @ ref[f"fc1.A.{s}"] for s in ("gate_proj", "up_proj")}
    gate, up = (x @ (w1[:FF] + d["gate_proj"]).T), (x @ (w1[FF:] + d["up_proj"]).T)
    y = (F.silu(gate) * up) @ (w2 + S * ref["fc2.B.down_proj"] @ ref["fc2.A.down_proj"]).T
    (y * gout).sum().backward()

    # megatron's expert MLP, each rank its etp shard, adapters wrapped as apply_peft does
    subs = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    mlp = MLP(config, subs, ffn_hidden_size=FF, is_expert=True, tp_group=group)
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(torch.cat([w1[:FF].chunk(2)[rank], w1[FF:].chunk(2)[rank]]))
        mlp.linear_fc2.weight.copy_(w2.chunk(2, dim=1)[rank])
    for p in mlp.parameters():
        p.requires_grad_(False)

    class Holder(torch.nn.Module):  # wrap_experts' view of a MoE layer: experts.local_experts
        def __init__(self):
            super().__init__()
            self.experts = torch.nn.Module()
            self.experts.local_experts = torch.nn.ModuleList([mlp])

    plan = plan_targets(["gate_proj", "up_proj", "down_proj"])
    geo = Geometry(H, 4 * FF, 4, 2, 4, 2, FF)
    wrap_experts(Holder(), plan, geo=geo, r=R, scale=S, dropout=0.0, dtype=torch.float32)
    ours = {}
    for short, lin in (("fc1", mlp.linear_fc1), ("fc2", mlp.linear_fc2)):
        for ab, params in (("A", lin.lora_A), ("B", lin.lora_B)):
            for key, p in params.items():
                name = f"{short}.{ab}.{key}"
                info = shard_info(f"x.lora_{ab}.{key}", p, p.shard_tp)
                with torch.no_grad():
                    p.copy_(take_shard(full[name], info, rank, p.shard_tp))
                p.requires_grad_(True)
                ours[name] = (p, info)
    out, _ = mlp(x.clone())
    (out * gout).sum().backward()
    total = out.detach().clone()
    dist.all_reduce(total, group=group)  # the dispatcher's combine sums the etp partial outputs
    errs = {"out": (total - y.detach()).abs().max().item()}
    for name, (p, info) in ours.items():
        want = take_shard(ref[name].grad, info, rank, p.shard_tp)
        errs[name] = (p.grad - want).abs().max().item()
    errs["scale"] = y.abs().max().item()
    return errs


@pytest.mark.dist
def test_expert_adapters_at_etp2(pool2):
    for errs in pool2.run(_etp_case):
        scale = errs.pop("scale")
        for what, e in errs.items():
            assert e <= 1e-5 * max(scale, 1.0), f"{what}: {e:.2e}"
