"""`python -m dspark_jax.simulate`: serving simulation (the code lives in `dspark_jax.scheduler.simulate`)."""
