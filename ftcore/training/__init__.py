"""The training loop's parts: trainer.py (setup in one fixed order, fit), step.py (the forward
step, the per-token loss, one global batch through megatron's schedule), optim.py (optimizer and
LR schedule), evaluation.py (the one evaluation loop), timing.py (the timer hook on a step),
metrics.py (metrics.jsonl, progress, wandb), overlap.py (the overlap options' hooks, manual GC),
dry_build.py (setup's model, adapters and optimizer on the meta device: plan.dry_build)."""
