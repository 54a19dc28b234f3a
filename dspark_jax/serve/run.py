"""Running an app under uvicorn: with the read timeouts of its limits (serve/timeouts.py) and the
connection's edges (serve/connection.py: a body cut short, closing without resetting an answer),
on a thread for tests and notebooks (`serve_in_thread`), or in the foreground until a signal
drains it or the engine gives up (`run_server`, what `python -m dspark_jax serve` exits with)."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import threading
import time

from dspark_jax.serve.connection import http_protocol
from dspark_jax.serve.served import Limits, Served

log = logging.getLogger(__name__)


def uvicorn_config(app, host, port, **uvicorn_kw):
    """uvicorn's configuration for `app`, with the read timeouts of its limits (`make_app` puts
    them on `app.state.limits`; the defaults of `Limits` when absent) and the connection edges
    (serve/connection.py)."""
    import uvicorn

    lim = getattr(getattr(app, "state", None), "limits", None) or Limits()
    uvicorn_kw.setdefault("http", http_protocol(lim.header_timeout, lim.body_timeout))
    return uvicorn.Config(app, host=host, port=port, **uvicorn_kw)


def serve_in_thread(app, host="127.0.0.1", port=0):
    """Start uvicorn for `app` on a thread (tests, notebooks): -> (server, thread, port). Stop it
    with `server.should_exit = True; thread.join()`."""
    import uvicorn

    if port == 0:
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
    # log_config=None: leave the process's logging alone (uvicorn would rebind handlers to the current
    # stderr, which pytest's capture or a notebook may close later)
    server = uvicorn.Server(uvicorn_config(app, host, port, log_level="warning", log_config=None,
                                           timeout_graceful_shutdown=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    return server, thread, port


def run_server(app, served: Served, host="127.0.0.1", port=8000, **uvicorn_kw) -> int:
    """Serve until SIGTERM / SIGINT (0, once open requests are drained) or until the engine cannot
    continue (1: /health said so while the server drained; `served.loop.error` says why)."""
    import uvicorn

    uvicorn_kw = {"log_level": "info", "timeout_graceful_shutdown": 30, **uvicorn_kw}
    server = uvicorn.Server(uvicorn_config(app, host, port, **uvicorn_kw))

    def fatal():
        server.should_exit = True

    served.loop.on_fatal = fatal
    if served.loop.error is not None:  # it died before the hook was in place
        fatal()
    with _drained_signals_return(server):
        server.run()
    return 0 if served.loop.error is None else 1


@contextlib.contextmanager
def _drained_signals_return(server):
    """uvicorn takes SIGTERM / SIGINT while it runs (it stops accepting and drains), then restores
    the handlers it found and raises the signal again. On the main thread, the handlers found are
    these, which take that repeat quietly, so a clean drain returns (the process exits 0, not 143);
    a signal before uvicorn's own handlers are in place stops `server` at its start. The previous
    handlers are back afterwards. Elsewhere uvicorn takes no signals: nothing to do."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    taken = []

    def take(sig, frame):
        taken.append(sig)
        server.should_exit = True

    previous = {sig: signal.signal(sig, take) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if taken:
            log.info("stopped by %s after draining", signal.Signals(taken[0]).name)
