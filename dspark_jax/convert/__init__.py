"""`python -m dspark_jax.convert`: DeepSpec reference-layout import/export (the code lives in `dspark_jax.io.reference`)."""
