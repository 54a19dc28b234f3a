"""`python -m dspark_jax serve`: an OpenAI-compatible server (completions, chat, streaming) with
continuous batching over the speculative engine.

    python -m dspark_jax serve                                   # embedded target (+ runs/dspark/drafter if trained)
    python -m dspark_jax serve --target DIR                      # DIR's own drafter (DIR/drafter or beside DIR) or none
    python -m dspark_jax serve --target DIR --drafter DIR        # scheduled on a cost table it measures itself
    python -m dspark_jax serve --target DIR --drafter DIR --policy early_stop --costs TABLE.json --calibrated
    python -m dspark_jax serve --api-key KEY --cors-origins https://app.example --host 0.0.0.0

Query it with any OpenAI client: base_url http://127.0.0.1:8000/v1, model as GET /v1/models says.
/health answers 503 "starting" until the engine's programs are compiled (--no-warmup: at once).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dspark_jax.cli import (
    add_dtype_argument,
    add_kv_pages_argument,
    add_mesh_argument,
    add_prefill_chunk_argument,
    report_user_errors,
)
from dspark_jax.serve.defaults import API_KEY_ENV, DEFAULT_DRAFTER, SERVE_PREFILL_CHUNK


def _temperature(value: str):
    return value if value == "auto" else float(value)


def parse_args(argv=None):
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
    ap.add_argument("--policy", default="auto", choices=("auto", "fixed", "threshold", "early_stop", "static",
                                                          "production"),
                    help="verification lengths. auto (default): the drafter kind's choice: a DSpark drafter with "
                         "its confidence head runs the production scheduler with the 'known' skip rule, others a "
                         "fixed length with drafting skipped where even perfect drafts would not pay; both on a "
                         "cost table the engine measures at start-up (kept in the user cache: a restart reads "
                         "it back). fixed: every round verifies gamma drafts")
    ap.add_argument("--threshold", type=float, default=0.0, help="--policy threshold: confidence threshold")
    ap.add_argument("--costs", default=None,
                    help="cost table JSON (python -m dspark_jax costs measure) instead of the engine's own; its "
                         "buckets become the engine's")
    ap.add_argument("--calibrated", nargs="?", type=_temperature, const=1.0, default="auto", metavar="T",
                    help="use the drafter's stored STS temperatures fitted at sampling temperature T (1 without "
                         "a value; the fit for the temperature most requests use: one set serves the whole "
                         "batch). Default: the fit at temperature 1 where the drafter has one")
    ap.add_argument("--no-sts", dest="calibrated", action="store_const", const=None,
                    help="no STS temperatures, even where the drafter has them")
    ap.add_argument("--skip-drafting", nargs="?", const="known", default="auto",
                    choices=("known", "acceptance", "best_case"),
                    help="with an explicit --policy: skip the drafter in rounds where the cost table says "
                         "speculation does not pay (python -m dspark_jax generate --help); --policy auto "
                         "chooses its own")
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


def startup_line(served, access, host, port) -> str:
    """One line saying what is served, how, under which limits and where."""
    eng, about, lim = served.loop.engine, served.about, served.limits
    kv = "" if eng.pages is None else f", KV pool {eng.pages.num_pages} pages x {eng.pages.page_size} tokens"
    kv += f", prefill chunks of {eng.prefill_chunk}" if eng.prefill_chunk else ""
    drafter = f"drafter {about['drafter']} ({about['drafter_why']})" if about["drafter"] else about["drafter_why"]
    return (f"[serve] model '{served.model}' ({eng.mode}, {eng.R} slots x {eng.S} tokens{kv}); {drafter}; "
            f"policy {about['policy']}; cost table {about['costs']}; limits: body {lim.max_body_bytes} "
            f"bytes, prompt {lim.max_prompt_chars} chars, {lim.max_messages} messages; read timeouts "
            f"{lim.header_timeout:g} s headers, {lim.body_timeout:g} s body; "
            f"API key {'required' if access.api_key else 'off'}; "
            f"CORS {', '.join(access.cors_origins) or 'off'}; docs {'on' if access.docs else 'off'}; "
            f"{'warming up, ' if not served.loop.ready.is_set() else ''}on http://{host}:{port}/v1")


def server_config(args):
    """The parsed flags as the library's ServerConfig."""
    from dspark_jax.cli import prefill_chunk
    from dspark_jax.parallel.sharding import parse_mesh
    from dspark_jax.serve.server import ServerConfig

    origins = tuple(o.strip() for o in args.cors_origins.split(",") if o.strip())
    return ServerConfig(policy=args.policy, threshold=args.threshold, costs=args.costs, calibrated=args.calibrated,
                        slots=args.slots, max_len=args.max_len, max_queue=args.max_queue,
                        model_name=args.model_name, dtype=args.dtype, mesh=parse_mesh(args.mesh),
                        skip_drafting=args.skip_drafting, kv_pages=args.kv_pages,
                        prefill_chunk=prefill_chunk(args.prefill_chunk), warmup=not args.no_warmup,
                        api_key=args.api_key or None, cors_origins=origins, docs=args.docs,
                        max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                        max_messages=args.max_messages, header_timeout=args.header_timeout,
                        body_timeout=args.body_timeout)


@report_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(format="%(levelname)s:  %(name)s: %(message)s")
    logging.getLogger("dspark_jax").setLevel(logging.INFO)
    from dspark_jax.serve.run import run_server
    from dspark_jax.serve.server import build

    config = server_config(args)
    try:
        app, served = build(args.target, args.drafter, config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(startup_line(served, config.access(), args.host, args.port), flush=True)
    rc = run_server(app, served, args.host, args.port)
    if served.loop.error is not None:
        print(f"error: the engine stopped: {served.loop.error!r}", file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
