"""The training loop's parts: trainer.py (setup in one fixed order, fit), step.py (the forward
step and the per-token loss), optim.py (optimizer and LR schedule), evaluation.py (the one
evaluation loop), metrics.py (metrics.jsonl, progress, wandb)."""
