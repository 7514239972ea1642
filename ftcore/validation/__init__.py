"""Everything that can refuse a run before anything is built: checks.py (the pinned order:
choices, divisibility, PEFT, hardware, memory fit, world size) and preflight.py (what the user
named: paths, adapters, base weights, the target GPU). It reads the models', planner's,
precision's and data's own rules, so it sits above them; training's setup() calls it first."""
