"""An OpenAI-compatible server over the speculative engine: `python -m dspark_jax serve` (see docs/serving.md)."""

__all__ = ["EngineLoop", "InvalidRequest", "QueueFull", "Request", "build", "run_server", "serve_in_thread"]


def __getattr__(name):  # loaded on first use, so `python -m dspark_jax serve --help` does not import jax
    if name in ("build", "run_server", "serve_in_thread"):
        from dspark_jax.serve import __main__ as cli

        return getattr(cli, name)
    if name in ("EngineLoop", "InvalidRequest", "QueueFull", "Request"):
        from dspark_jax.serve import loop

        return getattr(loop, name)
    raise AttributeError(name)
