"""An OpenAI-compatible server over the speculative engine: `python -m dspark_jax serve` (see docs/serving.md).

    server.py   build: models, engine, loop and app from a ServerConfig
    run.py      run_server (foreground, signals) / serve_in_thread (tests, notebooks)
    app.py      the routes; handler.py the generation handler; stream.py server-sent events
    schema.py / convert.py / protocol.py   the OpenAI API: request bodies in, answers out
    loop.py     the engine loop (continuous batching on one thread); warmup.py, request.py
"""

__all__ = ["EngineLoop", "InvalidRequest", "QueueFull", "Request", "ServerConfig", "build", "run_server",
           "serve_in_thread"]

_HOMES = {"build": "server", "ServerConfig": "server", "run_server": "run", "serve_in_thread": "run",
          "EngineLoop": "loop", "InvalidRequest": "request", "QueueFull": "request", "Request": "request"}


def __getattr__(name):  # loaded on first use, so `python -m dspark_jax serve --help` does not import jax
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(f"dspark_jax.serve.{_HOMES[name]}"), name)
    raise AttributeError(name)
