"""Benchmarks: ``python -m dspark_jax bench <subcommand>`` (see docs/benchmarks.md).

Each subcommand lives in its own module ``dspark_jax.bench.<name>`` exposing ``main(argv)``;
register it in ``SUBCOMMANDS`` (name -> (module, one-line help)).
"""

SUBCOMMANDS = {
    "regen": ("dspark_jax.bench.regen", "regeneration tokens/s (batch 1, 16) and compiled vs host decode loop"),
    "train": ("dspark_jax.bench.train", "drafter training step throughput"),
    "engine": ("dspark_jax.bench.engine", "speculative decoding engine throughput"),
    "vs-torch": ("dspark_jax.bench.vs_torch", "target forward vs transformers; "
                                              "train step, draft, verify vs an older commit"),
    "sampling": ("dspark_jax.bench.sampling", "top-p / top-k cut by bisection vs a full vocabulary sort"),
    "serve": ("dspark_jax.bench.serve", "the HTTP server under load: throughput vs per-user speed, TTFT, ITL"),
    "grid": ("dspark_jax.bench.grid", "reproduction-grid tables and plots from eval results (optionally runs evals)"),
    "roofline": ("dspark_jax.bench.roofline", "each decode program timed (or TPU-predicted) beside its roofline: "
                                              "bytes / bandwidth, FLOPs / matmul rate"),
}
