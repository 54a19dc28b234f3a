"""`python -m dspark_jax.costs`: verification cost tables (the code lives in `dspark_jax.scheduler.costs`)."""
