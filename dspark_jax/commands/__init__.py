"""The commands: one module per `python -m dspark_jax <command>`, each a parser and a `main` that
parses, calls the library and prints (the naming rule: dspark_jax/__main__.py). A command with
subcommands of their own modules dispatches through family.py (`plan`, `bench`: the benchmarks
and the reports that write docs/ are commands/bench/).

Commands sit above every other package: they resolve defaults (the embedded target, the
user cache), read arguments and call library code, importing it inside `main` so that
`--help` answers without starting JAX. Library modules import at module level.
"""
