"""Every run tests/gpu makes, as data: the GPU tests run them, and a CPU test
(tests/unit/precision/test_hardware.py) checks each passes ftcore's validation on its target GPU, so a test
that validation would refuse on CUDA (packing with micro-batch 4 did) cannot come back.

Importable without CUDA, Transformer Engine or megatron-core."""

from __future__ import annotations

from dataclasses import dataclass

STEPS = 30
# The tiny model (random weights, LoRA cases too), unpacked rows (packing on CUDA needs micro-batch
# 1), 30 steps, nothing saved.
BASE = (
    "+exp=tiny_full",
    "model.allow_random_base=true",
    "cluster.num_gpus=null",
    "data.packing=false",
    "train.micro_batch_size=4",
    "train.global_batch_size=16",
    "data.seq_len=128",
    f"train.max_steps={STEPS}",
    "eval.interval=0",
    "checkpoint.interval=0",
    "checkpoint.save_at_end=false",
    "logger.progress=lines",
)


@dataclass(frozen=True)
class Case:
    name: str
    extra: tuple[str, ...]
    gpus: int = 1
    te: bool = False  # needs Transformer Engine (NOT RUN without it, a failure with gpu.require_te)
    cluster: str = "h100"  # the GPU it targets (conf/cluster): its compute capability is checked
    refused: str | None = None  # validation must refuse it (exit 2) naming this field

    def overrides(self) -> list[str]:
        return [*BASE, f"cluster={self.cluster}", *self.extra]


def _c(name, *extra, **kw) -> Case:
    return Case(name, tuple(extra), **kw)


# issue 50: DPO from the stored reference (a LoRA adapter on the tiny model, the bundled pairs)
DPO = ("objective=dpo", "data.format=preference", "peft=lora", "objective.precompute_ref=true",
       "train.max_steps=6")  # fmt: skip
# a tiny Qwen3-MoE on the tiny model's shapes: 4 experts, top-2
MOE = ("model.family=qwen3_moe", "model.num_experts=4", "model.moe_ffn_hidden_size=176",
       "model.moe_router_topk=2", "model.moe_aux_loss_coeff=0.01", "train.max_steps=8")  # fmt: skip
EXPERT_LORA = ("peft=lora", "peft.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
               "down_proj]", "parallel.ep=2")  # fmt: skip


CASES: dict[str, Case] = {
    c.name: c
    for c in [
        # precision: the BF16 references and each FP8/FP4 recipe on the GPU that runs it
        _c("bf16_local", "precision=bf16", "precision.te_layers=false"),
        _c("fp32_local", "precision=fp32", "precision.te_layers=false"),
        _c("bf16_te", "precision=bf16", te=True),
        # DeepSeek-V3's latent attention and router on TE's spec (tests/gpu/test_deepseek_gpu.py
        # points model.hf_path at a tiny transformers checkpoint)
        _c("fp32_te_mla", "precision=fp32", te=True),
        _c("fp8_delayed", "precision=fp8_delayed", te=True),
        _c("fp8_cs", "precision=fp8_cs", te=True),
        _c("fp8_blockwise", "precision=fp8_blockwise", te=True),
        _c("mxfp8", "precision=mxfp8", te=True, cluster="b200"),
        _c(
            "nvfp4",
            "precision=nvfp4",
            "precision.first_last_bf16_layers=1",
            te=True,
            cluster="b200",
        ),
        # adapters: LoRA with the distributed optimizer off (finding 2), on an FP8 base, QLoRA
        _c(
            "lora_local",
            "peft=lora",
            "precision=bf16",
            "precision.te_layers=false",
            "parallel.distributed_optimizer=false",
        ),  # fmt: skip
        _c(
            "lora_te",
            "peft=lora",
            "precision=bf16",
            "parallel.distributed_optimizer=false",
            te=True,
        ),
        _c(
            "lora_fp8_cs",
            "peft=lora",
            "precision=fp8_cs",
            "parallel.distributed_optimizer=false",
            te=True,
        ),  # fmt: skip
        _c("qlora", "peft=qlora", "precision=bf16", "parallel.distributed_optimizer=false"),
        # FP8 weights loaded from a HF checkpoint (model.hf_path is added by the test; same shapes)
        _c("hf_bf16", "precision=bf16", "parallel.distributed_optimizer=true", te=True),
        _c(
            "hf_fp8_param_gather",
            "precision=fp8_cs",
            "precision.fp8_param_gather=true",
            "parallel.distributed_optimizer=true",
            te=True,
        ),  # fmt: skip
        # async checkpoint then resume
        _c(
            "ckpt",
            "precision=bf16",
            "precision.te_layers=false",
            "train.max_steps=10",
            "checkpoint.interval=5",
            "checkpoint.async_save=true",
        ),  # fmt: skip
        # the same with the distributed optimizer (issue 41, item 1: where TE is installed,
        # megatron's inner optimizer is TE's FusedAdam, whose state_dict has no per-tensor step)
        _c(
            "ckpt_distopt",
            "precision=bf16",
            "precision.te_layers=false",
            "train.max_steps=10",
            "checkpoint.interval=5",
            "checkpoint.async_save=true",
            "parallel.distributed_optimizer=true",
        ),  # fmt: skip
        _c(
            "ckpt_distopt_te",
            "precision=bf16",
            "train.max_steps=10",
            "checkpoint.interval=5",
            "checkpoint.async_save=true",
            "parallel.distributed_optimizer=true",
            te=True,
        ),  # fmt: skip
        # packed rows under CP=2 with TE's p2p ring, the one comm type TE takes THD with (item 3)
        _c(
            "cp2_packed_te",
            "precision=bf16",
            "data.packing=true",
            "train.micro_batch_size=1",
            "parallel.cp=2",
            "parallel.cp_comm_type=p2p",
            gpus=2,
            te=True,
        ),  # fmt: skip
        # TP=2 userbuffers under FP8 with BF16 first/last layers: communicators in both modes
        # (item 4); generation and evaluation derive a decode-safe config from it (item 5)
        _c(
            "tp2_ub_fp8",
            "precision=fp8_cs",
            "precision.first_last_bf16_layers=1",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.tp_comm_overlap=true",
            "data.packing=true",
            "train.micro_batch_size=1",
            gpus=2,
            te=True,
        ),  # fmt: skip
        # refused before anything is built: fp32 with TE layers on packed rows (item 6: no TE
        # attention backend), CUDA graphs (item 7: nothing captures them)
        _c(
            "fp32_te_packed",
            "precision=fp32",
            "data.packing=true",
            "train.micro_batch_size=1",
            te=True,
            refused="precision",
        ),  # fmt: skip
        _c(
            "cuda_graphs",
            "precision=bf16",
            "perf.cuda_graphs=transformer_engine",
            te=True,
            refused="perf.cuda_graphs",
        ),  # fmt: skip
        # packed (THD, one row per micro-batch) and the same documents unpacked
        _c(
            "packed_local",
            "precision=bf16",
            "precision.te_layers=false",
            "data.packing=true",
            "train.micro_batch_size=1",
        ),  # fmt: skip
        _c("packed_te", "precision=bf16", "data.packing=true", "train.micro_batch_size=1", te=True),
        # layouts on 2 GPUs, each compared with the 1-GPU run of the same precision
        _c(
            "tp2_sp",
            "precision=fp32",
            "precision.te_layers=false",
            "parallel.tp=2",
            "parallel.sp=true",
            gpus=2,
        ),  # fmt: skip
        _c("tp2_sp_te", "precision=bf16", "parallel.tp=2", "parallel.sp=true", gpus=2, te=True),
        _c("pp2", "precision=fp32", "precision.te_layers=false", "parallel.pp=2", gpus=2),
        _c("dp2", "precision=fp32", "precision.te_layers=false", gpus=2),
        # issue 50 (tests/gpu/test_gpu_door.py). Any GPU, TE or not (what `make gpu-check` runs on
        # every lent GPU): DPO's stored-reference pass, whose collectives took host tensors (item
        # 1), and a MoE step, whose router needed TE (item 2)
        _c("dpo_precompute", *DPO, "precision=bf16"),
        _c("dpo_precompute_dp2", *DPO, "precision=bf16", gpus=2),
        _c("moe", *MOE, "precision=bf16"),
        # expert LoRA on TE's spec (item 13): per-expert TE linears, against local layers
        _c("moe_lora_te_ep2", *MOE, *EXPERT_LORA, "precision=bf16", gpus=2, te=True),
        _c(
            "moe_lora_local_ep2",
            *MOE,
            *EXPERT_LORA,
            "precision=bf16",
            "precision.te_layers=false",
            gpus=2,
        ),  # fmt: skip
        # FP8 experts with the router padding (item 12), against BF16 ones, both grouped in TE
        _c("moe_fp8_te", *MOE, "precision=fp8_cs", te=True),
        _c("moe_bf16_te", *MOE, "precision=bf16", te=True),
        # FP8 weights under delayed scaling loaded from HF (item 4; model.hf_path added by the test)
        _c(
            "hf_fp8_delayed_param_gather",
            "precision=fp8_delayed",
            "precision.fp8_param_gather=true",
            "parallel.distributed_optimizer=true",
            te=True,
        ),  # fmt: skip
        # the stored reference's pass under delayed scaling (item 5)
        _c("dpo_precompute_fp8_delayed", *DPO, "precision=fp8_delayed", te=True),
        # userbuffers bootstrapped over NCCL under torchrun (item 6), BF16
        _c(
            "tp2_ub_bf16",
            "precision=bf16",
            "parallel.tp=2",
            "parallel.sp=true",
            "parallel.tp_comm_overlap=true",
            "data.packing=true",
            "train.micro_batch_size=1",
            gpus=2,
            te=True,
        ),  # fmt: skip
    ]
}
