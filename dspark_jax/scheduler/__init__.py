"""The hardware-aware prefix scheduler (prefix.py), verification cost tables (costs.py) and the
serving simulation (simulate.py). The package re-exports the scheduler's pure functions."""

from dspark_jax.scheduler.prefix import *  # noqa: F401,F403
from dspark_jax.scheduler.prefix import __all__  # noqa: F401
