"""The config: schema.py (the dataclasses Hydra composes conf/ into), and the checks that run
before anything is built: checks.py (in the pinned order), ranges.py (numeric fields),
preflight.py (what the user asked for: paths, adapters, CUDA), presets.py (a preset's evaluation
fitted to the user's data)."""
