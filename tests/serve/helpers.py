"""Shared by the server tests: raw HTTP on 127.0.0.1, starting and stopping a server in-process,
the process's resident memory."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

PROMPTS = ["def add(a, b):", "The capital of France", "Question: what is 3 + 4?", "import numpy as np\n",
           "Once upon a time", "x = [1, 2, 3]\nprint(", "Answer briefly.", "for i in range(10):"]
JSON = {"Content-Type": "application/json"}


def call(port, path, body=None, headers=None, method=None, timeout=60.0):
    """(status, headers, body text) of one request on 127.0.0.1:port. `body`: bytes, or an object
    sent as JSON."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if body is not None and not isinstance(body, (bytes, bytearray)):
            body = json.dumps(body).encode()
        hdrs = dict(JSON if body is not None else {}, **(headers or {}))
        conn.request(method or ("POST" if body is not None else "GET"), path, body=body, headers=hdrs)
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def post(port, path, body, **kw):
    """(status, parsed JSON body or the text)."""
    status, _, text = call(port, path, body, **kw)
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def is_error_body(obj) -> bool:
    e = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(e, dict) and isinstance(e.get("message"), str) and e["message"] and isinstance(e.get("type"), str)


def start(target_dir, drafter_dir, **kw):
    """build + serve_in_thread -> (served, server, thread, port)."""
    from dspark_jax.serve import build, serve_in_thread

    kw.setdefault("slots", 4)
    kw.setdefault("max_len", 128)
    app, served = build(str(target_dir), str(drafter_dir) if drafter_dir else "none", **kw)
    server, thread, port = serve_in_thread(app)
    assert server.started
    return served, server, thread, port


def stop(server, thread, served):
    server.should_exit = True
    thread.join(30)
    served.loop.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def wait_until(cond, timeout: float, step: float = 0.02) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step)
    return cond()


def metric(port, name: str) -> float:
    """The value of one sample line of /metrics (0 when absent)."""
    _, _, text = call(port, "/metrics")
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def in_thread(fn, *args):
    """Run fn(*args) on a thread -> (thread, result list)."""
    out: list = []
    th = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    th.start()
    return th, out
