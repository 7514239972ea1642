"""ftcore: fine-tune Llama-class models on megatron-core, LoRA or full, from a laptop CPU to SLURM."""

__version__ = "0.1.0"
