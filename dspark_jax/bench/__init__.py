"""Benchmarks and the reports that write docs/: what each measures and renders. Their command
lines are `python -m dspark_jax bench <benchmark>` (dspark_jax/commands/bench/)."""
