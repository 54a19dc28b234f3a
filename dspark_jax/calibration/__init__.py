"""Calibration of the confidence head: Sequential Temperature Scaling and metrics (sts.py),
fitting it on engine traces (calibrate.py), and the trace format (traces.py). The package
re-exports sts.py."""

from dspark_jax.calibration.sts import *  # noqa: F401,F403
from dspark_jax.calibration.sts import __all__  # noqa: F401
