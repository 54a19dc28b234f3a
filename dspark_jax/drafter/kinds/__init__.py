"""One adapter per drafter kind (base.py says what each must provide); registered in
`dspark_jax.drafter.registry`."""
