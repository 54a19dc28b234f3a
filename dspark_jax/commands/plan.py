"""`python -m dspark_jax plan train|engine`: per-chip memory plans of a preset, without devices."""

from __future__ import annotations

import sys

from dspark_jax.cli import report_user_errors
from dspark_jax.commands.family import Sub, dispatch

SUBCOMMANDS = {
    "train": Sub("dspark_jax.commands.train_plan",
                 "sharding check and per-chip memory of a preset's train / eval steps, no devices needed"),
    "engine": Sub("dspark_jax.commands.engine_plan",
                  "per-chip serving memory of the engine (weights, KV caches, compiled round) for a preset"),
}


@report_user_errors
def main(argv=None) -> int:
    return dispatch("plan", SUBCOMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
