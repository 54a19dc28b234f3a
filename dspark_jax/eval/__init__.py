"""Judging drafters: the `python -m dspark_jax eval` report (evaluate.py) and the reproduction
grid's tables and plots (grid.py)."""
