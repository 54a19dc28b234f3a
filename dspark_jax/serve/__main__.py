"""`python -m dspark_jax.serve`: an OpenAI-compatible server (completions, chat, streaming) with
continuous batching over the speculative engine.

    python -m dspark_jax.serve                                   # embedded target (+ runs/dspark/drafter if trained)
    python -m dspark_jax.serve --target DIR --drafter DIR --policy early_stop --costs TABLE.json --calibrated

Query it with any OpenAI client: base_url http://127.0.0.1:8000/v1, model as GET /v1/models says.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from dspark_jax.cli import SERVE_PREFILL_CHUNK, report_user_errors

DEFAULT_DRAFTER = Path("runs/dspark/drafter")  # where `python -m dspark_jax.train` (no arguments) writes it


def parse_args(argv=None):
    from dspark_jax.cli import add_dtype_argument
    from dspark_jax.cli import add_kv_pages_argument, add_mesh_argument, add_prefill_chunk_argument

    ap = argparse.ArgumentParser(prog="python -m dspark_jax.serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target)")
    add_dtype_argument(ap)
    add_mesh_argument(ap, "request slots over data, KV heads over tensor")
    ap.add_argument("--drafter", default=None,
                    help=f"drafter directory (default: {DEFAULT_DRAFTER} when it exists, else target-only); 'none' = target-only")
    ap.add_argument("--policy", default="fixed", choices=("fixed", "threshold", "early_stop", "static", "production"))
    ap.add_argument("--threshold", type=float, default=0.0, help="--policy threshold: confidence threshold")
    ap.add_argument("--costs", default=None, help="cost table JSON (python -m dspark_jax.costs measure); its buckets become the engine's")
    ap.add_argument("--calibrated", nargs="?", type=float, const=1.0, default=None, metavar="T",
                    help="use the drafter's stored STS temperatures fitted at sampling temperature T (default 1; "
                         "the fit for the temperature most requests use: one set serves the whole batch)")
    ap.add_argument("--skip-drafting", nargs="?", const="known", default=False, choices=("known", "best_case"),
                    help="scheduled policies: skip the drafter in rounds where the cost table says speculation "
                         "does not pay (python -m dspark_jax.generate --help)")
    ap.add_argument("--slots", type=int, default=8, help="requests decoded together (default 8)")
    ap.add_argument("--max-len", type=int, default=1024, help="context per slot: prompt + completion (default 1024)")
    add_kv_pages_argument(ap)
    add_prefill_chunk_argument(ap, SERVE_PREFILL_CHUNK)
    ap.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429 (default 64)")
    ap.add_argument("--model-name", default=None, help="the model id clients pass (default: the target directory's name)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    return ap.parse_args(argv)


def build(target=None, drafter=None, *, policy="fixed", threshold=0.0, costs=None, calibrated=None, slots=8,
          max_len=1024, max_queue=64, model_name=None, dtype="float32", mesh=None, skip_drafting=False,
          kv_pages=None, prefill_chunk=SERVE_PREFILL_CHUNK):
    """(FastAPI app, Served): models loaded, engine compiled lazily, loop thread started.
    `calibrated`: the STS fit at that sampling temperature (None: no STS).
    `prefill_chunk`: joining requests' prompts ride in the rounds (None / 0: whole prefills)."""
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine
    from dspark_jax.engine.generate import load_models
    from dspark_jax.serve.app import Served, make_app
    from dspark_jax.serve.loop import EngineLoop
    from dspark_jax.serve.metrics import ServerMetrics

    if drafter is None and DEFAULT_DRAFTER.is_dir():
        drafter = str(DEFAULT_DRAFTER)
    if drafter == "none":
        drafter = None
    lt, d, mode = load_models(target, drafter, None, dtype, mesh)
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
    eng = Engine(lt.model, d, num_slots=slots, max_len=max_len, policy=policy, table=table, mesh=mesh,
                 skip_drafting=skip_drafting, kv_pages=kv_pages,
                 prefill_chunk=prefill_chunk or None)
    metrics = ServerMetrics(eng.G)
    loop = EngineLoop(eng, max_queue=max_queue, metrics=metrics, threshold=threshold, sts=sts).start()
    served = Served(loop, tok, lt.chat_template, model_name or Path(str(lt.path)).name, metrics)
    return make_app(served), served


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
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", log_config=None,
                                           timeout_graceful_shutdown=30))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.05)
    return server, thread, port


@report_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    import uvicorn

    from dspark_jax.cli import prefill_chunk
    from dspark_jax.parallel.sharding import parse_mesh

    try:
        app, served = build(args.target, args.drafter, policy=args.policy, threshold=args.threshold, costs=args.costs,
                            calibrated=args.calibrated, slots=args.slots, max_len=args.max_len,
                            max_queue=args.max_queue, model_name=args.model_name, dtype=args.dtype,
                            mesh=parse_mesh(args.mesh), skip_drafting=args.skip_drafting,
                            kv_pages=args.kv_pages, prefill_chunk=prefill_chunk(args.prefill_chunk))
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    eng = served.loop.engine
    kv = "" if eng.pages is None else f", KV pool {eng.pages.num_pages} pages x {eng.pages.page_size} tokens"
    kv += f", prefill chunks of {eng.prefill_chunk}" if eng.prefill_chunk else ""
    print(f"[serve] model '{served.model}' ({eng.mode}, {eng.R} slots x {eng.S} tokens{kv}, policy {eng.policy_name}) "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
