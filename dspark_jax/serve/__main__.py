"""`python -m dspark_jax serve`: an OpenAI-compatible server (completions, chat, streaming) with
continuous batching over the speculative engine.

    python -m dspark_jax serve                                   # embedded target (+ runs/dspark/drafter if trained)
    python -m dspark_jax serve --target DIR                      # DIR's own drafter (DIR/drafter or beside DIR) or none
    python -m dspark_jax serve --target DIR --drafter DIR --policy early_stop --costs TABLE.json --calibrated
    python -m dspark_jax serve --api-key KEY --cors-origins https://app.example --host 0.0.0.0

Query it with any OpenAI client: base_url http://127.0.0.1:8000/v1, model as GET /v1/models says.
/health answers 503 "starting" until the engine's programs are compiled (--no-warmup: at once).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from dspark_jax.cli import SERVE_PREFILL_CHUNK, report_user_errors

log = logging.getLogger("dspark_jax.serve")

DEFAULT_DRAFTER = Path("runs/dspark/drafter")  # where `python -m dspark_jax.train` (no arguments) writes it
API_KEY_ENV = "DSPARK_API_KEY"


def parse_args(argv=None):
    from dspark_jax.cli import (
        add_dtype_argument,
        add_kv_pages_argument,
        add_mesh_argument,
        add_prefill_chunk_argument,
    )

    ap = argparse.ArgumentParser(prog="python -m dspark_jax serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target)")
    add_dtype_argument(ap)
    add_mesh_argument(ap, "request slots over data, KV heads over tensor")
    ap.add_argument("--drafter", default=None,
                    help=f"drafter directory; 'none' = target-only. Default: a drafter trained for this very target "
                         f"(its recorded fingerprint matches): {DEFAULT_DRAFTER} for the embedded target, "
                         "DIR/drafter or a 'drafter' directory beside DIR for --target DIR; else target-only")
    ap.add_argument("--policy", default="fixed", choices=("fixed", "threshold", "early_stop", "static", "production"))
    ap.add_argument("--threshold", type=float, default=0.0, help="--policy threshold: confidence threshold")
    ap.add_argument("--costs", default=None,
                    help="cost table JSON (python -m dspark_jax costs measure); its buckets become the engine's")
    ap.add_argument("--calibrated", nargs="?", type=float, const=1.0, default=None, metavar="T",
                    help="use the drafter's stored STS temperatures fitted at sampling temperature T (default 1; "
                         "the fit for the temperature most requests use: one set serves the whole batch)")
    ap.add_argument("--skip-drafting", nargs="?", const="known", default=False, choices=("known", "best_case"),
                    help="scheduled policies: skip the drafter in rounds where the cost table says speculation "
                         "does not pay (python -m dspark_jax generate --help)")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded together (default 8)")
    ap.add_argument("--max-len", type=int, default=1024, help="context per slot: prompt + completion (default 1024)")
    add_kv_pages_argument(ap)
    add_prefill_chunk_argument(ap, SERVE_PREFILL_CHUNK)
    ap.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (default 64)")
    ap.add_argument("--model-name", default=None,
                    help="the model id clients pass (default: the target directory's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                    help="require 'Authorization: Bearer KEY' on every /v1 route "
                         f"(default: ${API_KEY_ENV}; unset: none)")
    ap.add_argument("--cors-origins", default="",
                    help="comma-separated browser origins allowed by CORS, or '*' (default: none, no CORS headers)")
    ap.add_argument("--docs", action="store_true", help="serve /docs, /redoc and /openapi.json (default: off)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="answer /health 'ok' at once instead of compiling the engine's programs first")
    ap.add_argument("--max-body-bytes", type=int, default=None,
                    help="largest request body; larger ones get 413 (default: max(4 MiB, 8 x --max-prompt-chars))")
    ap.add_argument("--max-prompt-chars", type=int, default=None,
                    help="longest prompt / conversation in characters, checked before tokenizing "
                         "(default: max(65536, 32 x --max-len))")
    ap.add_argument("--max-messages", type=int, default=2048,
                    help="most messages in one chat request, counted before anything else (default 2048)")
    ap.add_argument("--header-timeout", type=float, default=30.0, metavar="S",
                    help="seconds a client may take to send a request's headers; then 408 and the "
                         "connection is closed (default 30)")
    ap.add_argument("--body-timeout", type=float, default=60.0, metavar="S",
                    help="seconds a client may take to send a request's body after its headers (default 60)")
    return ap.parse_args(argv)


def find_drafter(target, lt) -> tuple[str | None, str]:
    """The drafter to serve when none is named: one trained for this very target (its recorded
    fingerprint matches), from where training puts it -> (directory or None, why)."""
    from dspark_jax.drafter.frozen import target_fingerprint
    from dspark_jax.io.drafter_dir import read_config

    if target is None:
        candidates, where = [DEFAULT_DRAFTER], f"{DEFAULT_DRAFTER}"
    else:
        candidates, where = [Path(target) / "drafter", Path(target).parent / "drafter"], "in or beside the target"
    have = None
    for c in candidates:
        if not c.is_dir():
            continue
        try:
            _, fp = read_config(c)
        except (OSError, ValueError) as e:
            log.warning("not using %s as the drafter: %s", c, e)
            continue
        have = have or target_fingerprint(lt.model)
        if fp == have:
            return str(c), f"found {where}"
        log.warning("not using %s as the drafter: it was trained for another target (or records none)", c)
    return None, f"target-only: no drafter for this target {where}"


def build(target=None, drafter=None, *, policy="fixed", threshold=0.0, costs=None, calibrated=None, slots=8,
          max_len=1024, max_queue=64, model_name=None, dtype="float32", mesh=None, skip_drafting=False,
          kv_pages=None, prefill_chunk=SERVE_PREFILL_CHUNK, warmup=False, api_key=None, cors_origins=(),
          docs=False, max_body_bytes=None, max_prompt_chars=None, max_messages=2048, header_timeout=30.0,
          body_timeout=60.0):
    """(FastAPI app, Served): models loaded, loop thread started (with `warmup`, compiling the
    engine's programs first: /health says "starting" until then; else they compile on first use).
    `drafter`: a directory, "none", or None (find_drafter: one trained for this target, else none).
    `calibrated`: the STS fit at that sampling temperature (None: no STS).
    `prefill_chunk`: joining requests' prompts ride in the rounds (None / 0: whole prefills).
    `header_timeout` / `body_timeout`: seconds a client may take to send a request's headers / its
    body (serve/timeouts.py; `serve_in_thread` and `run_server` apply them)."""
    import jax.numpy as jnp

    from dspark_jax.commands.generate import load_models
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.serve.app import Access, Limits, Served, make_app
    from dspark_jax.serve.loop import EngineLoop
    from dspark_jax.serve.metrics import ServerMetrics

    find = drafter is None
    drafter = None if drafter == "none" else drafter
    why = "named" if drafter else "target-only (--drafter none)"
    lt, d, _ = load_models(target, drafter, None, dtype, mesh)
    if find:
        drafter, why = find_drafter(target, lt)
        if drafter is not None:
            from dspark_jax.io.drafter_dir import load as load_drafter

            tdt = lt.model.embed[...].dtype
            d = load_drafter(drafter, lt, dtype=None if tdt == jnp.float32 else tdt, mesh=mesh)
    if calibrated is not None and drafter is None:
        raise ValueError("--calibrated reads the drafter's STS temperatures: it needs a drafter")
    tok = lt.require_tokenizer()
    table = sts = None
    if costs:
        import jax

        from dspark_jax.scheduler.costs import load_cost_table

        table = load_cost_table(costs, expect_backend=jax.default_backend())
    if calibrated is not None:
        from dspark_jax.calibration.calibrate import load_temperatures

        sts = load_temperatures(drafter, SamplingParams(float(calibrated), 0, 1.0))
    max_len = min(int(max_len), lt.cfg.max_position_embeddings)
    config = EngineConfig(num_slots=slots, max_len=max_len, policy=policy, skip_drafting=skip_drafting,
                          kv_pages=kv_pages, prefill_chunk=prefill_chunk or None)
    eng = Engine(lt.model, d, config, table=table, mesh=mesh)
    metrics = ServerMetrics(eng.G)
    loop = EngineLoop(eng, max_queue=max_queue, metrics=metrics, threshold=threshold, sts=sts, warmup=warmup).start()
    chars = int(max_prompt_chars or max(65536, 32 * max_len))
    for name, seconds in (("--header-timeout", header_timeout), ("--body-timeout", body_timeout)):
        if not seconds > 0:
            raise ValueError(f"{name} must be a number of seconds > 0, got {seconds}")
    limits = Limits(max_body_bytes=int(max_body_bytes or max(4 << 20, 8 * chars)), max_prompt_chars=chars,
                    max_messages=int(max_messages), header_timeout=float(header_timeout),
                    body_timeout=float(body_timeout))
    served = Served(loop, tok, lt.chat_template, model_name or Path(str(lt.path)).name, metrics, limits)
    served.about = {"drafter": drafter, "drafter_why": why, "policy": eng.policy_name, "costs": costs}
    access = Access(api_key=api_key or None, cors_origins=tuple(cors_origins), docs=bool(docs))
    return make_app(served, access), served


def uvicorn_config(app, host, port, **uvicorn_kw):
    """uvicorn's configuration for `app`, with the read timeouts of its limits (`make_app` puts
    them on `app.state.limits`; the defaults of `Limits` when absent)."""
    import uvicorn

    from dspark_jax.serve.app import Limits
    from dspark_jax.serve.timeouts import timed_protocol

    lim = getattr(getattr(app, "state", None), "limits", None) or Limits()
    uvicorn_kw.setdefault("http", timed_protocol(lim.header_timeout, lim.body_timeout))
    return uvicorn.Config(app, host=host, port=port, **uvicorn_kw)


def serve_in_thread(app, host="127.0.0.1", port=0):
    """Start uvicorn for `app` on a thread (tests, notebooks): -> (server, thread, port). Stop it
    with `server.should_exit = True; thread.join()`."""
    import socket
    import time

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


def run_server(app, served, host="127.0.0.1", port=8000, **uvicorn_kw) -> int:
    """Serve until SIGTERM / SIGINT (0, once open requests are drained) or until the engine cannot
    continue (1: /health said so while the server drained)."""
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
    if served.loop.error is not None:
        print(f"error: the engine stopped: {served.loop.error!r}", file=sys.stderr, flush=True)
        return 1
    return 0


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


def startup_line(served, access, host, port) -> str:
    eng, about, lim = served.loop.engine, served.about, served.limits
    kv = "" if eng.pages is None else f", KV pool {eng.pages.num_pages} pages x {eng.pages.page_size} tokens"
    kv += f", prefill chunks of {eng.prefill_chunk}" if eng.prefill_chunk else ""
    drafter = f"drafter {about['drafter']} ({about['drafter_why']})" if about["drafter"] else about["drafter_why"]
    return (f"[serve] model '{served.model}' ({eng.mode}, {eng.R} slots x {eng.S} tokens{kv}); {drafter}; "
            f"policy {about['policy']}; cost table {about['costs'] or 'none'}; limits: body {lim.max_body_bytes} "
            f"bytes, prompt {lim.max_prompt_chars} chars, {lim.max_messages} messages; read timeouts "
            f"{lim.header_timeout:g} s headers, {lim.body_timeout:g} s body; "
            f"API key {'required' if access.api_key else 'off'}; "
            f"CORS {', '.join(access.cors_origins) or 'off'}; docs {'on' if access.docs else 'off'}; "
            f"{'warming up, ' if not served.loop.ready.is_set() else ''}on http://{host}:{port}/v1")


@report_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(levelname)s:  %(name)s: %(message)s")
    logging.getLogger("dspark_jax").setLevel(logging.INFO)
    from dspark_jax.cli import prefill_chunk
    from dspark_jax.parallel.sharding import parse_mesh
    from dspark_jax.serve.app import Access

    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    access = Access(api_key=args.api_key or None, cors_origins=origins, docs=args.docs)
    try:
        app, served = build(args.target, args.drafter, policy=args.policy, threshold=args.threshold, costs=args.costs,
                            calibrated=args.calibrated, slots=args.slots, max_len=args.max_len,
                            max_queue=args.max_queue, model_name=args.model_name, dtype=args.dtype,
                            mesh=parse_mesh(args.mesh), skip_drafting=args.skip_drafting,
                            kv_pages=args.kv_pages, prefill_chunk=prefill_chunk(args.prefill_chunk),
                            warmup=not args.no_warmup, api_key=access.api_key, cors_origins=origins, docs=args.docs,
                            max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                            max_messages=args.max_messages, header_timeout=args.header_timeout,
                            body_timeout=args.body_timeout)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(startup_line(served, access, args.host, args.port), flush=True)
    return run_server(app, served, args.host, args.port)


if __name__ == "__main__":
    sys.exit(main())
