"""The server's defaults that its command line shows in --help: kept free of JAX, so the help
answers at once, and defined once for the command and the library."""

from __future__ import annotations

from pathlib import Path

DEFAULT_DRAFTER = Path("runs/dspark/drafter")  # where `python -m dspark_jax.train` (no arguments) writes it
API_KEY_ENV = "DSPARK_API_KEY"  # the API key when --api-key is not given
SERVE_PREFILL_CHUNK = 64  # prompt tokens a round forwards for a request joining others
