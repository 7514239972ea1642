"""Precision: recipes.py maps the `precision` config onto megatron and Transformer Engine,
hardware.py checks that a machine (or a target GPU, simulated on CPU) runs it, ngc.py pins the
NGC container whose Transformer Engine runs every recipe."""
