"""dspark_jax: DSpark speculative decoding (drafter, confidence head, prefix scheduler) in JAX/Flax NNX."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so `import dspark_jax` stays cheap (no jax import) for CLIs that only print --help.
    if name == "load_target":
        from dspark_jax.io.hf import load_target

        return load_target
    raise AttributeError(name)
