"""`python -m dspark_jax.generate`: speculative decoding of prompts (the code lives in `dspark_jax.engine.generate`)."""
