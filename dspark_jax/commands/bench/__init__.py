"""`python -m dspark_jax bench <benchmark>`: benchmarks and the reports that write docs/ (see
docs/benchmarks.md). Each benchmark is a module of its own exposing `main(argv)`; register it in
`SUBCOMMANDS`."""

from __future__ import annotations

import sys

from dspark_jax.cli import report_user_errors
from dspark_jax.commands.family import Sub, dispatch


def _here(name: str, summary: str) -> Sub:
    return Sub(f"{__name__}.{name}", summary)


SUBCOMMANDS = {
    "regen": _here("regen", "regeneration tokens/s (batch 1, 16) and compiled vs host decode loop"),
    "train": _here("train", "drafter training step throughput"),
    "engine": _here("engine", "speculative decoding engine throughput"),
    "vs-torch": _here("vs_torch", "target forward vs transformers; train step, draft, verify vs an older commit"),
    "sampling": _here("sampling", "top-p / top-k cut by bisection vs a full vocabulary sort"),
    "serve": _here("serve", "the HTTP server under load: throughput vs per-user speed, TTFT, ITL"),
    "grid": _here("grid", "reproduction-grid tables and plots from eval results (optionally runs evals)"),
    "roofline": _here("roofline", "each decode program timed (or TPU-predicted) beside its roofline: "
                                  "bytes / bandwidth, FLOPs / matmul rate"),
    "step": _here("step", "the target-only decode step on a TPU slice against its read-once price, and where its "
                          "time goes (predicted)"),
    "round": _here("round", "the draft, the round at every bucket and the skipped round on a TPU slice against their "
                            "read-once price, HBM floor and collectives (predicted)"),
    "accelerator": _here("accelerator", "first contact with an accelerator in one budgeted run: versions, bandwidth "
                                        "and matmul rate, the GPU kernel vs the reference, every decode program vs "
                                        "its roofline, compiled memory, compile seconds"),
    "tpu-memory": _here("tpu_memory", "docs/tpu_memory.md: every preset compiled by the TPU compiler for its slice "
                                      "(resumable)"),
    "tpu-predict": _here("tpu_predict", "docs/tpu_predictions.md: DSpark's speed on TPU slices from the TPU "
                                        "compiler's cost model, beside published TPU runs (resumable)"),
}


@report_user_errors
def main(argv=None) -> int:
    return dispatch("bench", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
