"""What the benchmarks and the TPU reports compute, as library code: the roofline model of the
decode programs and their measured / TPU-predicted times (roofline_*.py), and the report of
docs/tpu_predictions.md with its plots (tpu_report.py, tpu_plots.py). The benchmarks themselves
are commands: `python -m dspark_jax bench <benchmark>` (dspark_jax/commands/bench/)."""
