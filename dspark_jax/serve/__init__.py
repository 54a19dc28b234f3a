"""An OpenAI-compatible server over the speculative engine: `python -m dspark_jax.serve` (see docs/serving.md)."""

from dspark_jax.serve.loop import EngineLoop, QueueFull, Request

__all__ = ["EngineLoop", "QueueFull", "Request", "build", "serve_in_thread"]


def __getattr__(name):
    if name in ("build", "serve_in_thread"):
        from dspark_jax.serve import __main__ as cli

        return getattr(cli, name)
    raise AttributeError(name)
