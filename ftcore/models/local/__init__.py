"""The local (CPU) layer spec: what megatron's non-Transformer-Engine layers need to run on CPU
under every layout: SDPA core attention with document masking (attention.py), RMSNorm that works
with sequence parallelism (norm.py), a fused SwiGLU (swiglu.py) and row gathers (gather.py).

GPU runs use Transformer Engine's layer spec instead (precision/recipes.py `layer_spec`); QLoRA
keeps this spec on GPU too, since bitsandbytes quantises plain weights."""
