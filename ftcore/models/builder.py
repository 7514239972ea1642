"""Build this rank's model: one megatron-core GPTModel per virtual pipeline stage.

No high-precision copy of an FP8/FP4 weight survives the build. megatron asks Transformer Engine
to keep one whenever grad mode is on at build time (`preserve_high_precision_init_val=
torch.is_grad_enabled()` in megatron's fp8_utils); TE then holds `param.detach().cpu()` per weight,
and megatron frees it only for parameters its distributed optimizer owns. For a frozen base that is
a BF16 host copy of every weight (~100 GB per rank for 405B); for a base loaded afterwards
(model.hf_path) it is the random init, which the distributed optimizer would take as the fp32 main
weights. Building under torch.no_grad() would avoid it, but TE also sets the weights' column-wise
(transposed) usage from grad mode at that moment, and MXFP8/blockwise tensors cannot make their
column-wise data later. So the build keeps megatron's grad mode and drops each copy the moment its
parameter is registered (`init_copies_dropped`): one weight's copy at a time, none after.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from omegaconf import DictConfig

from ftcore.models import init as model_init
from ftcore.models import speed, target_logits
from ftcore.models.llama import layer_spec, padded_vocab_size, transformer_config
from ftcore.planner.params import init_method
from ftcore.precision import recipes
from ftcore.runtime import cpu


def build_model(
    cfg: DictConfig, *, vocab_size: int | None = None, init: bool = True
) -> list[GPTModel]:
    """Unwrapped GPTModel chunks of this rank, initialised layout-independently (`init=False`:
    left as built, for the planner's dry build on the meta device, which has no values)."""
    on_cpu = cpu.is_active()
    config = transformer_config(cfg, on_cpu=on_cpu)
    vocab = vocab_size or cfg.model.vocab_size
    tp = ps.get_tensor_model_parallel_world_size()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    rope = cfg.model.rope_scaling
    chunks = []
    with cpu.device_mode(), init_copies_dropped():  # (module docstring)
        for vp_stage in range(cfg.parallel.vp):
            chunk = GPTModel(
                config=config,
                transformer_layer_spec=layer_spec(
                    cfg, config, on_cpu=on_cpu, vp_stage=vp_stage, pp_rank=pp_rank
                ),
                vocab_size=padded_vocab_size(vocab, tp),
                max_sequence_length=cfg.model.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                share_embeddings_and_output_weights=cfg.model.tie_embeddings,
                position_embedding_type="rope",
                rotary_base=int(cfg.model.rope_theta),
                rotary_percent=float(cfg.model.get("rotary_percent") or 1.0),  # GLM-4.5: 0.5
                rope_scaling=rope is not None and rope.get("rope_type", "llama3") == "llama3",
                rope_scaling_factor=rope.factor if rope is not None else 8.0,
                vp_stage=vp_stage if cfg.parallel.vp > 1 else None,
            )
            chunk.vocab_size_unpadded = vocab
            chunk.uses_te = not on_cpu and recipes.use_te(cfg)  # step.py: THD packing, no mask
            if chunk.post_process:
                target_logits.install(chunk)
            if not on_cpu:
                chunk.cuda(torch.cuda.current_device())
            elif chunk.post_process:
                cpu.contiguous_output_grad(chunk.output_layer)
            chunks.append(chunk)
    for chunk in chunks:  # a copy attached after its registration, should TE ever do that
        for p in chunk.parameters():
            drop_init_copy(p)
    from ftcore.models import rope

    rope.install(chunks, cfg.model)  # HF's inv_freq from all four llama3 rope_scaling fields
    if cfg.model.hf_path or cfg.model.init_path or not init:
        return chunks  # loaded next (ftcore.hf.io.load_weights), or a dry build (nothing to draw)
    method = init_method(cfg, on_gpu=not on_cpu)  # auto: sharded on GPU for large models
    draw = model_init.init_shards if method == "sharded" else model_init.init_weights
    draw(
        chunks,
        seed=cfg.run.seed,
        std=cfg.model.init_std,
        num_layers=cfg.model.num_layers,
        vocab_size=vocab,
        tp=tp,
        tp_rank=ps.get_tensor_model_parallel_rank(),
    )
    return chunks


def drop_init_copy(param: torch.Tensor) -> bool:
    """Free the high-precision init copy Transformer Engine attaches to an FP8/FP4 parameter and
    remove its accessors too: megatron's distributed optimizer takes the main weights from any
    parameter that still has `get_high_precision_init_val`. True when there was a copy."""
    if not hasattr(param, "get_high_precision_init_val"):
        return False
    had = param.get_high_precision_init_val() is not None
    param.clear_high_precision_init_val()
    del param.get_high_precision_init_val, param.clear_high_precision_init_val
    return had


@contextmanager
def init_copies_dropped():
    """While inside: every parameter registered on any module loses its high-precision init copy
    as it is registered (TE attaches the copy just before it registers the quantized weight)."""
    from torch.nn.modules.module import register_module_parameter_registration_hook

    def on_registration(module, name, param) -> None:  # None: torch keeps the parameter
        drop_init_copy(param)

    handle = register_module_parameter_registration_hook(on_registration)
    try:
        yield
    finally:
        handle.remove()


def wrap_ddp(cfg: DictConfig, chunks: list[GPTModel]):
    """megatron DDP around each chunk: contiguous grad buffers, DP reduction, distributed optimizer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        # grad dtype, overlapped DP reduce / param gather (models/speed.py)
        **speed.ddp_config_kwargs(cfg),
        use_distributed_optimizer=cfg.parallel.distributed_optimizer,
        check_for_nan_in_grad=False,
        bucket_size=None,
        **recipes.ddp_config_kwargs(cfg),
    )
    wrapped = []
    with cpu.device_mode():
        for i, chunk in enumerate(chunks):
            wrapped.append(
                DistributedDataParallel(
                    config=chunk.config,
                    ddp_config=ddp_config,
                    module=chunk,
                    disable_bucketing=i > 0,
                )
            )
    if ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
        for chunk in wrapped:
            gather_parameter_containers(chunk)
    # with overlap off DDP's gradient hook only adds .grad into main_grad: peft/fused.py may do
    # that add itself and skip the hook
    if not ddp_config.overlap_grad_reduce:
        for chunk in wrapped:
            for param in chunk.module.parameters():
                if param.requires_grad:
                    param.ftcore_grad_into_main = True
    return wrapped


def gather_parameter_containers(ddp) -> None:
    """megatron DDP's forward pre-hooks wait for the all-gather of each module's OWN parameters;
    parameters held in an `nn.ParameterDict`/`ParameterList` (LoRA's adapters) belong to a
    container whose forward never runs, so their gather would be dispatched and never waited
    (stale shards from the second step on; under VP a handle left open). The container's owner
    runs DDP's hook for the container before its own forward."""
    containers = (torch.nn.ParameterDict, torch.nn.ParameterList)
    for owner in ddp.module.modules():
        held = [c for c in owner.children() if isinstance(c, containers)]
        if held:
            hook = ddp._make_forward_pre_hook()  # megatron's own: wait, dispatch the next bucket
            handle = owner.register_forward_pre_hook(
                lambda _m, _a, held=held, hook=hook: [hook(c) for c in held] and None
            )
            ddp.ftcore_container_hooks = [*getattr(ddp, "ftcore_container_hooks", []), handle]


def params_current(model: list) -> None:
    """Finish any parameter all-gather the overlap left for the next forward: afterwards every
    rank's parameters hold the optimizer's last update. A no-op without overlap_param_gather."""
    for chunk in model:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and ddp.use_distributed_optimizer and ddp.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)
