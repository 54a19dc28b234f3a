"""The commands: one module per `python -m dspark_jax <command>`, each a parser and a `main`.

Commands sit above every other package: they resolve defaults (the embedded target, the
user cache), read arguments and call library code, importing it inside `main` so that
`--help` answers without starting JAX. Library modules import at module level.
"""
