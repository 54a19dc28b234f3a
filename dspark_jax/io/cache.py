"""The user cache: built and fetched targets, regenerated data (`$DSPARK_JAX_CACHE`, else ~/.cache/dspark_jax)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DSPARK_JAX_CACHE"


def cache_root() -> Path:
    """``$DSPARK_JAX_CACHE`` or ``~/.cache/dspark_jax``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dspark_jax"
