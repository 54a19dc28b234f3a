"""`python -m dspark_jax.models`: fetch real target models (the code lives in `dspark_jax.io.models`)."""
