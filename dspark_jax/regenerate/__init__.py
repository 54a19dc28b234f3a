"""`python -m dspark_jax.regenerate`: regenerate assistant turns with the target (the code lives in `dspark_jax.data.regenerate`)."""
