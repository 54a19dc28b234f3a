"""`python -m dspark_jax.calibrate`: fit STS on engine traces (the code lives in `dspark_jax.calibration.calibrate`)."""
