"""The config schema: one dataclass per config group (docs/design.md), the types Hydra merges the
YAML files of `conf/` into, so an unknown key or a wrong type fails at compose time with the key's
name. Composition itself, and its errors, are in ftcore.config.schema.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING

from ftcore.config.commands import (
    BenchConfig,
    ClusterConfig,
    ExportConfig,
    GenerateConfig,
    GpuConfig,
    PlanConfig,
)
from ftcore.config.k8s import K8sConfig

TRAINING_PATH = "training_path"  # the field metadata `switch` sets


def switch(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING) -> Any:
    """A key that changes the training path (which code runs, not only how fast or where): every
    such key is a dimension of the parity matrix (tests/support/matrix.py), which runs its values
    crossed with every layout against the one-process run, and docs/parallelism.md lists it. A new
    key that changes what runs is declared with `switch(...)`: the matrix test then fails until
    the table has it (docs/parallelism.md, "How a feature joins the matrix")."""
    return field(default=default, default_factory=factory, metadata={TRAINING_PATH: True})


def training_path_keys(node: type | None = None, prefix: str = "") -> list[str]:
    """The dotted keys declared with `switch`, in schema order."""
    out = []
    for f in dataclasses.fields(node or FtcoreConfig):
        if f.metadata.get(TRAINING_PATH):
            out.append(prefix + f.name)
        elif dataclasses.is_dataclass(f.default_factory):
            out += training_path_keys(f.default_factory, f"{prefix}{f.name}.")
    return out


@dataclass
class RunConfig:
    exp: str = "default"  # set by each exp/ file; names the output directory
    dir: Optional[str] = None  # default outputs/<exp>/<job id or timestamp>, decided once by rank 0
    seed: int = 1234
    max_time: Optional[float] = None  # minutes; stop, save and exit 3 when reached
    stop_file: Optional[str] = None  # default <run.dir>/STOP: a launcher asks the ranks to stop
    handle_signals: bool = True  # SIGTERM/SIGUSR1 -> save at the step boundary, exit 3
    # who writes this run's checkpoints: the job scripts set it (slurm:<cluster>:<job id>) where
    # run.dir is derived from the job; each manifest records it, and checkpoint.resume=auto
    # refuses a checkpoint written under another id (docs/checkpoints.md)
    id: Optional[str] = None
    # the command line's overrides, recorded by compose(): what the user set explicitly, as opposed
    # to what a preset (+exp=NAME) set (ftcore/config/presets.py adapts only the latter)
    overrides: list[str] = field(default_factory=list)


@dataclass
class LauncherConfig:
    nproc_per_node: int = 1
    # CPU: torch threads per worker (default cores / workers)
    threads_per_rank: Optional[int] = None


@dataclass
class RopeScalingConfig:
    """RoPE scaling of HF config.json: llama3 (Llama 3.1+) or yarn (DeepSeek-V3's MLA only)."""

    rope_type: str = "llama3"  # llama3 | yarn
    factor: float = 8.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float = 1.0  # yarn: the cos/sin concentration's numerator
    mscale_all_dim: float = 0.0  # yarn: its denominator, and the softmax scale's (squared)


@dataclass
class ModelConfig:
    name: str = MISSING
    # llama | qwen2 (q/k/v biases) | qwen3 (q/k RMSNorm) | mistral | qwen3_moe | mixtral (MoE):
    # ftcore/config/families.py; read from config.json's `architectures` with model.hf_path
    family: str = "llama"
    # a local HF directory: shapes, weights and tokenizer come from it
    hf_path: Optional[str] = None
    tokenizer: Optional[str] = None  # a tokenizer directory; default: hf_path, else the bundled one
    num_layers: int = MISSING
    hidden_size: int = MISSING
    ffn_hidden_size: int = MISSING
    num_attention_heads: int = MISSING
    num_query_groups: int = MISSING  # kv heads (GQA)
    kv_channels: Optional[int] = None  # head dim; default hidden / heads
    vocab_size: int = MISSING
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: Optional[RopeScalingConfig] = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    # a safetensors base shipped in assets (tiny_lora's pretrained base)
    init_path: Optional[str] = None
    # random init without hf_path/init_path: auto | layout_independent | sharded. auto = sharded
    # (each rank draws its shard on its GPU; not layout-independent) on GPU from 1e9 params on
    init_method: str = "auto"
    # adapters (peft=lora/qlora) on a random base are refused unless this is set: for benchmarks
    # and tests that need no real weights
    allow_random_base: bool = False
    # mixture of experts (docs/moe.md); None = a dense model
    num_experts: Optional[int] = switch(None)
    moe_ffn_hidden_size: Optional[int] = None  # per expert (HF moe_intermediate_size)
    moe_router_topk: int = 2  # experts per token
    moe_norm_topk_prob: bool = True  # the top-k probabilities renormalised to sum to 1
    # layers with a dense MLP of ffn_hidden_size (HF mlp_only_layers, decoder_sparse_step)
    moe_dense_layers: list[int] = field(default_factory=list)
    moe_aux_loss_coeff: float = 0.0  # HF router_aux_loss_coef, used as given
    # DeepSeek-V3 / GLM-4.5 routing (docs/deepseek.md): shared experts of this total width (HF
    # n_shared_experts x moe_intermediate_size), sigmoid scores, an expert bias
    # (e_score_correction_bias) for the choice, group-limited top-k, a scaled router output
    moe_shared_expert_ffn_hidden_size: Optional[int] = None
    moe_router_score_function: str = "softmax"  # softmax | sigmoid
    moe_router_expert_bias: bool = False
    moe_router_num_groups: Optional[int] = None  # HF n_group (None: no groups)
    moe_router_group_topk: Optional[int] = None  # HF topk_group
    moe_router_topk_scaling_factor: float = 1.0  # HF routed_scaling_factor
    # q/k/v biases and per-head q/k norms; None = the family's (GLM-4.5: attention_bias, use_qk_norm)
    qkv_bias: Optional[bool] = None
    qk_layernorm: Optional[bool] = None
    rotary_percent: float = 1.0  # share of the head dim RoPE rotates (HF partial_rotary_factor)
    # multi-head latent attention (family deepseek_v3): q down to q_lora_rank (None: one q_proj),
    # k/v down to kv_lora_rank, heads of qk_nope_head_dim + qk_rope_head_dim (q, k) and v_head_dim
    q_lora_rank: Optional[int] = None
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    # the checkpoint's FP8 weight block (quantization_config.weight_block_size, [128, 128] as
    # DeepSeek publishes): its FP8 weights are read dequantized (docs/deepseek.md); null = not FP8
    fp8_block: Optional[list[int]] = None
    # multi-token-prediction layers in the checkpoint (HF num_nextn_predict_layers): carried into
    # the export unchanged, never built or trained
    mtp_layers: int = 0


@dataclass
class ParallelConfig:
    tp: int = switch(1)
    pp: int = switch(1)
    vp: int = switch(1)  # virtual stages per pipeline rank (1 = no interleaving)
    # uneven pipeline stages (pp > 1): transformer layers on the first / last pipeline rank, the
    # ranks between share the rest equally; each a multiple of vp (megatron's
    # num_layers_in_first/last_pipeline_stage; docs/parallelism.md). None = megatron's own split
    pp_first_stage_layers: Optional[int] = switch(None)
    pp_last_stage_layers: Optional[int] = switch(None)
    cp: int = switch(1)
    # how Transformer Engine's attention exchanges K/V across the CP group on GPU (megatron's
    # cp_comm_type): p2p | all_gather | a2a | a2a+p2p (docs/context_parallel.md). The CPU path is
    # all-gather.
    cp_comm_type: str = "p2p"
    # a2a+p2p only: [all-to-all group, ring] sizes, product = cp (megatron's
    # hierarchical_context_parallel_sizes): all-to-all inside a node, the ring across nodes
    hierarchical_cp_sizes: Optional[list[int]] = None
    sp: bool = switch(False)  # sequence parallel, only with tp > 1
    distributed_optimizer: bool = switch(False)
    recompute: str = switch("none")  # none | selective | full
    # selective: what is recomputed (megatron's recompute_modules): core_attn | mlp | layernorm
    recompute_modules: list[str] = field(default_factory=lambda: ["core_attn"])
    recompute_num_layers: int = 1  # full: layers per recomputed block (uniform method)
    # communication overlap (docs/gpu_speed.md): DP gradient reduce per bucket during the backward;
    # with the distributed optimizer, the parameter all-gather per bucket during the next forward
    overlap_grad_reduce: bool = switch(False)
    overlap_param_gather: bool = switch(False)
    # interleaved pipeline (pp > 1, vp > 1; a no-op elsewhere): sends/receives left in flight
    # during compute (batch_p2p_comm off)
    overlap_p2p_comm: bool = switch(False)
    # GPU: TP/SP collectives split and hidden behind the GEMMs by TE userbuffers (with tp > 1:
    # needs parallel.sp, TE and fixed sequence shapes; a no-op at tp = 1)
    tp_comm_overlap: bool = False
    ep: int = switch(1)  # expert parallel: each rank holds num_experts / ep experts (MoE only)
    etp: int = 1  # expert tensor parallel: TP inside each expert (Megatron-Bridge's default 1)


@dataclass
class MoeConfig:
    """Router and dispatcher settings of a mixture-of-experts model (docs/moe.md)."""

    capacity_factor: Optional[float] = None  # None = dropless
    z_loss_coeff: Optional[float] = None  # router z-loss; None = off
    aux_loss_coeff: Optional[float] = None  # None = model.moe_aux_loss_coeff
    router_dtype: str = "fp32"  # the router's softmax and top-k in fp32
    dispatcher: str = "alltoall"  # megatron's token dispatcher
    # aux-loss-free balancing of a model with an expert bias (DeepSeek-V3, GLM-4.5): each step
    # moves every expert's bias by this much toward the mean load (megatron's
    # moe_router_bias_update_rate). 0 keeps the published bias; metrics log the largest move.
    expert_bias_update_rate: float = switch(0.0)


@dataclass
class PerfConfig:
    """Kernel fusions, gradient-reduce dtype, garbage collection, CUDA graphs (docs/gpu_speed.md)."""

    bias_activation_fusion: bool = True  # one SwiGLU kernel (megatron's on GPU, ftcore's on CPU)
    gradient_accumulation_fusion: bool = False  # GPU (TE): wgrad GEMMs accumulate into main_grad
    grad_reduce_dtype: str = "fp32"  # fp32 | bf16: dtype of the grad buffers and DP reduction
    manual_gc: bool = False  # Python GC off, a collection every manual_gc_interval steps instead
    manual_gc_interval: int = 0  # steps between collections; 0 = one at the start only
    # none. transformer_engine is refused: nothing in ftcore captures graphs (issue 41, item 7)
    cuda_graphs: str = "none"


@dataclass
class TrainConfig:
    max_steps: int = 100
    global_batch_size: int = 16
    micro_batch_size: int = 2
    grad_clip: float = 1.0
    skip_bad_steps: int = 0  # NaN/Inf steps skipped (not applied) before the run stops
    # passes over the training rows; when set, max_steps = ceil(epochs * rows / global_batch_size)
    # (a preset's max_steps yields to it; both on the command line is refused)
    epochs: Optional[float] = None


@dataclass
class OptimConfig:
    name: str = "adamw"  # adam | adamw
    lr: float = 3e-4
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8


@dataclass
class SchedConfig:
    name: str = "cosine"  # cosine | linear | constant
    warmup_steps: int = 10
    min_lr: float = 0.0


@dataclass
class EvalConfig:
    interval: int = 0  # steps; 0 = off
    iters: int = 4  # validation batches (of train.global_batch_size) per evaluation
    output: Optional[str] = None  # ftcore.eval's JSON; default <run.dir>/eval.json
    accuracy: bool = False  # exact-match accuracy for instruction data
    max_samples: Optional[int] = None


@dataclass
class CheckpointConfig:
    interval: int = 0  # steps; 0 = off
    keep: int = 2
    resume: str = "auto"  # auto | never | PATH
    save_at_end: bool = True
    # GPU only: write in the background, publish when done (CPU: synchronous)
    async_save: bool = True
    verify: bool = True  # checksums of every file: written at save, checked before a load
    # keys that decide the data stream (data.*, run.seed) a resumed run may change from its
    # checkpoint's; the new data is then read from its start (docs/checkpoints.md). Others apply.
    allow_changed: list[str] = field(default_factory=list)


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online
    project: str = "ftcore"


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    log_interval: int = 1
    progress: str = "auto"  # auto | bar | lines


@dataclass
class PeftConfig:
    name: str = switch("none")  # none | lora | qlora
    r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["linear_qkv"])
    use_rslora: bool = False
    adapter_path: Optional[str] = None
    double_quant: bool = True  # qlora: quantise the NF4 absmax constants too


@dataclass
class RewardConfig:
    """One reward function of objective=grpo (docs/grpo.md): a built-in by name (exact_answer,
    last_number, regex) or the user's own as `module:function`, TRL's signature
    `f(prompts, completions, **columns) -> list[float]`, imported only when named."""

    fn: str = MISSING
    weight: float = 1.0
    column: Optional[str] = None  # exact_answer, last_number: the record's answer column
    pattern: Optional[str] = None  # regex: what the whole completion must match
    name: Optional[str] = None  # the metric's name (rewards/NAME/mean); default the function's


@dataclass
class ObjectiveConfig:
    """What a step minimises: sft (next-token cross entropy), dpo (preference pairs, TRL 1.x's
    definitions; docs/preference.md) or grpo (online RL on prompts, TRL 1.16's GRPOTrainer;
    docs/grpo.md)."""

    name: str = switch("sft")  # sft | dpo | grpo
    # dpo: the KL strength (TRL's beta); grpo: the k3 KL penalty to the reference (0: none)
    beta: float = 0.1
    # dpo: a list of TRL's loss names (sigmoid, ipo, hinge, sft), summed with loss_weights (null:
    # 1.0 each); grpo: one name (grpo, dapo, dr_grpo, bnpo)
    loss_type: Any = switch(factory=lambda: ["sigmoid"])
    loss_weights: Optional[list[float]] = None
    label_smoothing: float = 0.0  # dpo, sigmoid only (conservative DPO), in [0, 0.5)
    # dpo with LoRA: the reference is the base plus this adapter, and the policy starts from it
    ref_adapter_path: Optional[str] = switch(None)
    # dpo: reference log-probs from a first pass over the data, stored per pair in run.dir (full
    # fine-tuning: no frozen copy; LoRA: no forward without adapters per step)
    precompute_ref: bool = switch(False)
    # grpo (TRL's GRPOConfig names): completions sampled per prompt; train.global_batch_size
    # counts completions, so a step takes global_batch_size / num_generations prompts
    num_generations: int = 8
    max_completion_length: int = 256
    temperature: float = 1.0  # sampling, and the log-probs of the loss (TRL divides the logits)
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    epsilon: float = 0.2  # the ratio's clip range below 1
    epsilon_high: Optional[float] = None  # above 1 (null: epsilon; DAPO uses 0.28)
    scale_rewards: str = "group"  # group | batch | none
    num_iterations: int = 1  # policy updates per rollout batch (old log-probs kept)
    mask_truncated_completions: bool = False
    # the KL term times the ratio r (TRL 1.16's default): its gradient the unbiased reverse-KL one
    use_bias_correction_kl: bool = True
    rewards: list[RewardConfig] = field(default_factory=list)


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    params_dtype: str = "fp32"  # fp32 | bf16: compute and parameter dtype of the base
    fp8_recipe: Optional[str] = None  # delayed | tensorwise | blockwise | mxfp8
    fp4_recipe: Optional[str] = None  # nvfp4
    # e4m3 | hybrid (E5M2 grads); default per recipe (ftcore.precision.recipes)
    fp8_format: Optional[str] = None
    te_layers: bool = True  # GPU: Transformer Engine layers when installed (FP8/FP4 need them)
    first_last_bf16_layers: int = 0  # keep this many layers at each end in BF16
    fp8_param_gather: bool = False
    fp8_attention: bool = False  # FP8 for the attention core (dot product attention)
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_margin: int = 0


@dataclass
class DataMixEntry:
    path: str = MISSING
    weight: float = 1.0
    format: Optional[str] = None


@dataclass
class DataConfig:
    path: Optional[str] = None  # JSONL/JSON/Parquet file or directory; default: the bundled sample
    # auto (from the records: ftcore/data/formats.py) | instruction | chat | prompt_completion |
    # text | preference (prompt/chosen/rejected pairs, for objective=dpo: docs/preference.md)
    format: str = "auto"
    seq_len: int = 256
    packing: bool = switch(False)
    # packing places each document at its length rounded up to this (only to decide the rows; no
    # token is padded at cp=1), so the rows are the same at every cp with 2*cp dividing it: 16 up
    # to cp=8 (docs/context_parallel.md)
    pack_multiple: int = 16
    # unpacked: cut each micro-batch to its longest row (same loss, less padding compute)
    trim_padding: bool = True
    truncate: str = "right"  # right | drop
    on_bad_record: str = "error"  # error | skip
    chat_template: Optional[str] = None  # llama3 | chatml | PATH; default: the tokenizer's own
    train_on_prompt: bool = False
    val_path: Optional[str] = None
    val_fraction: float = 0.0
    cache_dir: Optional[str] = None  # default ~/.cache/ftcore/data
    tokenize_workers: int = 0  # processes building the cache; 0 = every CPU for data >= 32 MB
    mix: list[DataMixEntry] = field(default_factory=list)
    max_samples: Optional[int] = None


@dataclass
class FtcoreConfig:
    run: RunConfig = field(default_factory=RunConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    perf: PerfConfig = field(default_factory=PerfConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    peft: PeftConfig = field(default_factory=PeftConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    gpu: GpuConfig = field(default_factory=GpuConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    k8s: K8sConfig = field(default_factory=K8sConfig)  # python -m ftcore.launch.k8s
