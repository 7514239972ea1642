"""Collectives get tensors on the device their GPU-path backend serves (issue 24, finding 1).

On the GPU the default group is NCCL, which rejects host tensors; on the CPU everything is gloo,
so these runs go through ftcore.runtime.device_audit, which tags each tensor with the device the
GPU path would give it and fails any collective that would hand NCCL a host tensor. The runs:
a TP=2/PP=2 LoRA job with SP (setup's parameter count, train steps, an evaluation, 2-token
generation across 4 ranks, the adapter gather, the HF export's weight gathers); a DP=2 job with the
distributed optimizer stopped by a stop file (the stop check, the loss/token sums, the checkpoint
save); a DP=2 full fine-tuning job with the distributed optimizer (a step, an evaluation, the
end-of-run HF export); issue 50: LoRA DPO with precompute_ref and an ep=2 MoE step (and the
blocking host-to-device copies of their steps), and the collectives door's own refusals."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

LORA = ["peft=lora", "peft.r=4", "peft.lora_alpha=8", "sched.warmup_steps=0"]


def audit_catches_host_tensors() -> dict:
    """The audit itself: which tensors it lets through to an all-reduce on the default group."""
    import torch.distributed as dist

    from ftcore.runtime import device_audit
    from ftcore.runtime.dist import comm_device

    def passes(make) -> bool:
        try:
            dist.all_reduce(make())
            return True
        except device_audit.HostTensorInCollective:
            return False

    with device_audit.shadow_devices():
        gloo = dist.new_group([0, 1], backend="gloo")
        on_gpu = torch.ones(3, device=torch.cuda.current_device())
        out = {
            "no device": passes(lambda: torch.tensor([1.0, 2.0])),
            "cpu()": passes(lambda: on_gpu.cpu()),
            "host op": passes(lambda: torch.zeros(2) + 1),
            "from_list": passes(lambda: torch.tensor([1.0]).view(1, 1)[0]),
            "cuda str": passes(lambda: torch.zeros(2, device="cuda")),
            "current_device": passes(lambda: on_gpu),
            "x.device": passes(lambda: torch.zeros(2, device=on_gpu.device)),
            "cuda()": passes(lambda: torch.zeros(2).cuda()),
            "to cuda": passes(lambda: torch.zeros(2).to("cuda:0", torch.float64)),
            "mixed op": passes(lambda: on_gpu * torch.tensor(2.0)),
            "comm_device": passes(lambda: torch.zeros(2, device=comm_device())),
        }
        host = torch.zeros(2)
        dist.all_reduce(host, group=gloo)  # gloo groups take host tensors on the GPU too
        on_gpu.cuda().add_(1)  # .cuda() of a CUDA tensor is the tensor itself
        out["host stays host after cuda()"] = not device_audit.is_host(host.cuda()) and (
            device_audit.is_host(host)
        )
    out["restored"] = not device_audit.active() and torch.cuda.current_device() == torch.device(
        "cpu"
    )
    return out


@pytest.mark.dist
def test_audit_tells_host_from_gpu_tensors(pool2):
    for res in pool2.run(audit_catches_host_tensors):
        host = {"no device", "cpu()", "host op", "from_list"}
        assert {k for k, ok in res.items() if not ok} == host, res


def lora_tp2_pp2(run_dir: str, audit: bool) -> list:
    import contextlib

    from ftcore.hf.export import write_hf_model
    from ftcore.inference.generation import generate_ids
    from ftcore.peft.adapter_format import gather_full
    from ftcore.runtime import device_audit
    from ftcore.training import trainer
    from ftcore.training.evaluation import evaluate
    from tests.support.layouts import build

    with device_audit.shadow_devices() if audit else contextlib.nullcontext():
        state = build(LORA + ["parallel.tp=2", "parallel.pp=2", "parallel.sp=true"], run_dir)
        losses = [trainer.train_step(state)["loss"] for _ in range(2)]
        losses.append(evaluate(state, [state.loader.next_microbatches()]).loss)
        answers = generate_ids(state, [[1, 2, 3], [4, 5]], max_new_tokens=2)
        full = gather_full(state.model, everywhere=True)
        if audit:
            write_hf_model(state)
    return [losses, answers, sorted(full)]


@pytest.mark.dist
def test_tp2_pp2_lora_collectives_get_gpu_tensors(pool4, tmp_path):
    res = pool4.run(lora_tp2_pp2, str(tmp_path / "audit"), audit=True)
    assert all(r == res[0] for r in res[1:]), res  # every rank reports the same answers
    losses, answers, names = res[0]
    assert all(torch.isfinite(torch.tensor(losses))) and len(answers[0]) == 2 and names
    # the audit changes no number: the same run without it gives bitwise the same results
    assert pool4.run(lora_tp2_pp2, str(tmp_path / "plain"), audit=False)[0] == res[0]


def dp2_stop_audited(run_dir: str) -> dict:
    from ftcore.runtime import device_audit
    from tests.multiproc.test_signals import fit_until_stop

    with device_audit.shadow_devices():
        return fit_until_stop(
            ["train.max_steps=3", "checkpoint.keep=0", "parallel.distributed_optimizer=true"],
            run_dir,
        )


@pytest.mark.dist
def test_dp2_distributed_optimizer_stop_file_collectives_get_gpu_tensors(pool2, tmp_path):
    (tmp_path / "STOP").write_text("")
    res = pool2.run(dp2_stop_audited, str(tmp_path))
    assert [r["stopped"][0] for r in res] == [1, 1] and "stop file" in res[0]["stopped"][1], res


def dp2_full_eval_export(run_dir: str) -> dict:
    """Evaluation and the end-of-run export under the distributed optimizer (issue 41)."""
    from ftcore.hf.export import write_hf_model
    from ftcore.runtime import device_audit
    from ftcore.training import trainer
    from ftcore.training.evaluation import evaluate
    from tests.support.layouts import build

    with device_audit.shadow_devices():
        state = build(["parallel.distributed_optimizer=true", "parallel.overlap_param_gather=true",
                       "parallel.overlap_grad_reduce=true"], run_dir)  # fmt: skip
        loss = trainer.train_step(state)["loss"]
        ev = evaluate(state, [state.loader.next_microbatches()])
        out = write_hf_model(state)
    return {"loss": loss, "eval": ev.loss, "files": sorted(p.name for p in out.iterdir())}


@pytest.mark.dist
def test_dp2_evaluation_and_export_collectives_get_gpu_tensors(pool2, tmp_path):
    res = pool2.run(dp2_full_eval_export, str(tmp_path))
    assert res[0]["eval"] == res[1]["eval"] and torch.isfinite(torch.tensor(res[0]["eval"]))
    assert "config.json" in res[0]["files"], res[0]


def cp2_packed_audited(run_dir: str) -> dict:
    """Context parallelism with packed rows (the CPU's all-gather attention, its K/V and document
    collectives) and an evaluation under the audit (issue 41)."""
    from ftcore.runtime import device_audit
    from ftcore.training import trainer
    from ftcore.training.evaluation import evaluate
    from tests.support.layouts import build

    with device_audit.shadow_devices():
        state = build(["parallel.cp=2", "data.packing=true"], run_dir)
        loss = trainer.train_step(state)["loss"]
        ev = evaluate(state, [state.loader.next_microbatches()])
    return {"loss": loss, "eval": ev.loss}


@pytest.mark.dist
def test_cp2_packed_collectives_get_gpu_tensors(pool2, tmp_path):
    res = pool2.run(cp2_packed_audited, str(tmp_path))
    assert res[0] == res[1] and all(torch.isfinite(torch.tensor(list(res[0].values())))), res


MOE = ["model.family=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=64",
       "model.moe_router_topk=2", "model.moe_aux_loss_coeff=0.01", "parallel.ep=2"]  # fmt: skip


def dpo_precompute_and_moe_audited(run_dir: str) -> dict:
    """Issue 50, items 1 and 8: LoRA DPO with objective.precompute_ref (the stored file's
    agreement, the held-out table's size and the pass's table sums are collectives) and an ep=2
    MoE step (the router's token counts and metrics), under the audit; the blocking
    host-to-device copies made inside each training step, by call site. Item 5: the reference
    forwards of the pass, and how many FP8 delayed-scaling updates followed them."""
    from collections import Counter

    from ftcore.config.schema import compose
    from ftcore.precision import delayed
    from ftcore.runtime import device_audit
    from ftcore.training import trainer
    from ftcore.training.objectives.dpo import step as dpo
    from tests.multiproc.test_dpo_parity import BASE, PRE
    from tests.support.layouts import build

    out = {"reference forwards": 0, "updates": 0}
    loss, update = dpo._reference_loss, delayed.update_after_no_grad_forward

    def counted(*args, **kwargs):
        out["reference forwards"] += 1
        return loss(*args, **kwargs)

    def counted_update(cfg):
        out["updates"] += 1

    lora = ["peft=lora", "peft.r=4", "peft.lora_alpha=8", "optim.lr=5e-3"]
    with device_audit.shadow_devices():
        over = [*BASE, *lora, *PRE, "train.global_batch_size=8", f"run.dir={run_dir}/dpo"]
        dpo._reference_loss, delayed.update_after_no_grad_forward = counted, counted_update
        try:
            state = trainer.setup(compose(over))
        finally:
            dpo._reference_loss, delayed.update_after_no_grad_forward = loss, update
        device_audit.reset_copies()
        out["dpo"] = trainer.train_step(state)["loss"]
        out["dpo_copies"] = Counter(device_audit.blocking_copies())
        out["dpo_microbatches"] = len(state.loader.next_microbatches())
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    with device_audit.shadow_devices():
        state = build([*MOE, "train.micro_batch_size=1"], f"{run_dir}/moe")
        device_audit.reset_copies()
        out["moe"] = trainer.train_step(state)["loss"]
        out["moe_copies"] = Counter(device_audit.blocking_copies())
        out["moe_microbatches"] = len(state.loader.next_microbatches())
    return out


@pytest.mark.dist
def test_dpo_precompute_and_moe_collectives_get_gpu_tensors(pool2, tmp_path):
    """Item 1: the precompute pass handed NCCL host tensors (the door refuses them). Item 5: each
    of its no-grad reference forwards is followed by TE's delayed-scaling update (a no-op but
    under fp8_delayed with TE), which TE skips without grad. Item 8: no
    blocking host-to-device copy is made once per micro-batch (the MoE token count and DPO's
    stored reference rows were): with 4 micro-batches a step, no call site of ftcore's copies 4
    times (the step's own sums copy once or twice a step). megatron's router moves its weight
    to the GPU at each forward here, where ftcore's build (chunk.cuda) has not moved it first:
    not counted."""
    import ftcore

    own = str(Path(ftcore.__file__).parent) + os.sep
    res = pool2.run(dpo_precompute_and_moe_audited, str(tmp_path))
    for r in res:
        assert torch.isfinite(torch.tensor([r["dpo"], r["moe"]])).all(), r
        assert r["updates"] == r["reference forwards"] >= 12, r  # 24 pairs / 2 ranks
        for kind in ("dpo", "moe"):
            n = r[f"{kind}_microbatches"]
            assert n == 4, r
            per_microbatch = {site: k for site, k in r[f"{kind}_copies"].items()
                              if k >= n and site.startswith(own)}  # fmt: skip
            assert not per_microbatch, (kind, per_microbatch)


def door_case() -> dict:
    """Worker: what the collectives door (runtime/collectives.py) refuses, outside and inside the
    device audit."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ftcore.runtime import collectives, device_audit
    from ftcore.runtime.dist import comm_device

    def refused(fn) -> str | None:
        try:
            fn()
        except collectives.HostTensorInCollective as e:
            return str(e)
        return None

    world = dist.get_world_size()
    out = {"cpu run": refused(lambda: collectives.all_reduce(torch.ones(2)))}
    with device_audit.shadow_devices():
        ps.initialize_model_parallel(create_gloo_process_groups=True)
        tp, dp_gloo = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group_gloo()
        on_gpu = lambda: torch.zeros(2, device=comm_device())  # noqa: E731
        out.update({
            "host, default group": refused(lambda: collectives.all_reduce(torch.tensor([1.0]))),
            "host, tp group": refused(lambda: collectives.all_reduce(torch.zeros(2), group=tp)),
            "host, dp gloo group": refused(lambda: collectives.all_reduce(torch.zeros(2), group=dp_gloo)),
            "device, default group": refused(lambda: collectives.all_reduce(on_gpu())),
            "host output of a gather": refused(lambda: collectives.all_gather([torch.zeros(2)] * world, on_gpu())),
            "host, broadcast": refused(lambda: collectives.broadcast(torch.zeros(2).cpu(), src=0)),
            "object with a device tensor": refused(lambda: collectives.all_gather_object([None] * world, {"w": [on_gpu()]})),
            "object with a host tensor": refused(lambda: collectives.all_gather_object([None] * world, {"w": on_gpu().cpu()})),
        })  # fmt: skip
        ranks = list(range(world))
        gloo, plain = collectives.new_group(ranks, backend="gloo"), collectives.new_group(ranks)
        out["backends"] = {name: collectives.gpu_backend(g) for name, g in
                           [("default", None), ("tp", tp), ("dp gloo", dp_gloo), ("new gloo", gloo),
                            ("new", plain)]}  # fmt: skip
    return out


@pytest.mark.dist
def test_the_door_refuses_a_host_tensor_where_nccl_would_be_used(pool2):
    """Issue 50: the collectives door (runtime/collectives.py), on 2 ranks: where the GPU path uses
    NCCL (the default group, megatron's TP group) a host tensor is refused, naming the call and
    the fix; megatron's gloo groups take it; an object holding a device tensor is refused."""
    out = pool2.run(door_case)[0]
    assert out.pop("backends") == {"default": "nccl", "tp": "nccl", "dp gloo": "gloo",
                                   "new gloo": "gloo", "new": "nccl"}  # fmt: skip
    refused = {k for k, v in out.items() if v}
    assert refused == {"host, default group", "host, tp group", "host output of a gather",
                       "host, broadcast", "object with a device tensor"}, out  # fmt: skip
    msg = out["host, default group"]
    assert msg.startswith("all_reduce on a nccl group got a host tensor (1,)") and "Fix:" in msg
    assert "comm_device()" in msg and "test_device_audit.py" in msg  # where it was made
    assert (
        "all_gather_object" in out["object with a device tensor"]
        and ".cpu()" in out["object with a device tensor"]
    )
