"""Benchmarks: `python -m ftcore.bench +bench=NAME` (bench/__main__.py).

dispatch.py picks the kind (layouts.py, vs_hf.py); runner.py starts each configuration in a fresh
process (worker.py for ftcore, hf_recipe.py for the Hugging Face Trainer recipe), taking turns
where asked (turns.py); report.py writes bench.md and bench.png.
"""
