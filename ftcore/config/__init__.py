"""The config schema, the floor every other package stands on: groups.py (the dataclasses Hydra
composes conf/ into), schema.py (compose, the run's overrides), ranges.py (numeric fields),
presets.py (a preset's evaluation fitted to the user's data), families.py (the model families:
what sets each apart from Llama). Nothing here imports ftcore beyond errors.py; the checks that
read the model, planner and data are ftcore/validation/."""
