"""Whole recipes as one resumable command: fetch a target, train drafters, evaluate, time them.

`python -m dspark_jax recipe NAME --out DIR` (see `recipes.RECIPES` and docs/real_model.md).
"""
