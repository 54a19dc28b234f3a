"""`python -m dspark_jax generate`: speculative (or target-only) generation from the command line.

    python -m dspark_jax generate --prompts prompts.jsonl --drafter runs/dspark/drafter --mode dspark
    echo "What is 12 + 7?" | python -m dspark_jax generate --mode ar

Prompts: a jsonl file (`{"turns": [...]}` or `{"conversations": [...]}` lines) or, without
`--prompts`, one user message per non-empty stdin line. They are rendered with the target's
chat template (generation prompt appended). Prints each completion and per-request
statistics (rounds, mean accepted length tau, tokens/s), then a summary line.
Python API: `dspark_jax.engine.Engine`, `dspark_jax.io.loading.load_models`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dspark_jax.cli import report_user_errors


def parse_args(argv=None):
    from dspark_jax.cli import (
        add_dtype_argument,
        add_kv_pages_argument,
        add_mesh_argument,
        add_prefill_chunk_argument,
    )

    ap = argparse.ArgumentParser(prog="python -m dspark_jax generate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target)")
    add_dtype_argument(ap)
    add_mesh_argument(ap, "request slots over data, KV heads over tensor")
    ap.add_argument("--drafter", default=None, help="drafter directory written by the train or convert command")
    from dspark_jax.names import KIND_NAMES as KINDS

    ap.add_argument("--mode", default=None, choices=("ar", *KINDS),
                    help="default: the drafter's kind, or ar without a drafter")
    ap.add_argument("--prompts", default=None, help="prompts jsonl (default: stdin, one message per line)")
    ap.add_argument("--gamma", type=int, default=None, help="verification length (<= the drafter's block size)")
    ap.add_argument("--policy", default="auto",
                    choices=("auto", "fixed", "threshold", "early_stop", "static", "production"),
                    help="verification-length policy. auto (default): the drafter kind's choice (DSpark with its "
                         "confidence head: production with the 'known' skip rule; others: fixed, drafting skipped "
                         "where even perfect drafts would not pay); fixed gamma; a static confidence threshold; "
                         "or the prefix scheduler (Algorithm 1 / static-shape / production). Scheduling prices "
                         "rounds with --costs, else with a table the engine measures on its own programs (kept "
                         "in the user cache: the next run with the same shapes reads it back)")
    ap.add_argument("--threshold", type=float, default=0.0, help="static confidence threshold (--policy threshold)")
    ap.add_argument("--costs", default=None,
                    help="cost table JSON from `python -m dspark_jax costs measure` (its buckets become the engine's)")
    ap.add_argument("--theta", default="latency", choices=("sps", "latency"),
                    help="scheduler objective: tau*SPS(B) (paper) or tau/(T_draft+T_verify(B))")
    ap.add_argument("--cost-model", default=None, choices=("interp", "step"),
                    help="price of B tokens between buckets (default: the policy's own)")
    ap.add_argument("--skip-drafting", nargs="?", const="known", default="auto",
                    choices=("known", "acceptance", "best_case"),
                    help="with an explicit --policy: skip the drafter in rounds where the cost table says no "
                         "speculation pays: 'known' (without a value) on the last known survivals, probing every "
                         "8 rounds; 'acceptance' on the acceptance of past rounds (any drafter, policy fixed); "
                         "'best_case' only when even perfect drafts would not pay. --policy auto chooses its own")
    ap.add_argument("--probe-every", type=int, default=8,
                    help="--skip-drafting known / acceptance: rounds skipped before drafting again to refresh "
                         "the survivals")
    ap.add_argument("--probe-max", type=int, default=64,
                    help="--skip-drafting known / acceptance: that interval doubles up to this while drafting "
                         "does not pay")
    ap.add_argument("--calibrated", action="store_const", const=True, default="auto",
                    help="require the STS temperatures stored with the drafter for this sampling (python -m "
                         "dspark_jax calibrate). Default: used where the drafter has them")
    ap.add_argument("--no-sts", dest="calibrated", action="store_const", const=False,
                    help="no STS temperatures, even where the drafter has them")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8, help="request slots decoded together")
    ap.add_argument("--max-len", type=int, default=None,
                    help="KV length per slot (default: longest prompt + max new + gamma + 2)")
    add_kv_pages_argument(ap)
    add_prefill_chunk_argument(ap, None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loop", default="host", choices=("host", "while"))
    ap.add_argument("--traces", default=None,
                    help="write per-round traces (.jsonl or .npz); with --policy auto every round then verifies "
                         "all drafts (the traces calibrate reads)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per request instead of text")
    return ap.parse_args(argv)


def read_prompts(path: str | None, stream=None) -> list[list[dict]]:
    """Conversations from a jsonl file (line numbers in errors) or plain stdin lines."""
    from dspark_jax.data.formats import read_conversations

    if path:
        convs = read_conversations(path)
    else:
        stream = stream or sys.stdin
        convs = [[{"role": "user", "content": line.rstrip("\n")}] for line in stream if line.strip()]
    if not convs:
        raise ValueError(f"no prompts in {path or 'stdin'}")
    return convs


def scheduling_inputs(args, sampling):
    """(cost table or None, STS temperatures or None) from --costs / --calibrated, checked before
    any model is loaded: a table from another backend and missing temperatures fail here."""

    from dspark_jax.calibration.calibrate import load_temperatures, stored_temperatures
    from dspark_jax.parallel.platform import platform
    from dspark_jax.scheduler.costs import load_cost_table

    table = load_cost_table(args.costs, expect_backend=platform()) if args.costs else None
    sts = None
    if args.calibrated is True:
        if not args.drafter:
            raise ValueError("--calibrated needs --drafter DIR (the STS temperatures are stored with the drafter)")
        sts = load_temperatures(args.drafter, sampling)
    elif args.calibrated == "auto" and args.drafter and args.drafter != "none":
        sts = stored_temperatures(args.drafter, sampling)
    return table, sts


@report_user_errors
def main(argv=None) -> int:
    args = parse_args(argv)
    from dspark_jax.calibration.calibrate import CalibrationMissingError
    from dspark_jax.cli import prefill_chunk
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.drafter.frozen import TargetMismatchError
    from dspark_jax.embedded.target import resolve_target_dir
    from dspark_jax.engine import EngineError
    from dspark_jax.engine import texts as engine_texts
    from dspark_jax.io.loading import load_models
    from dspark_jax.parallel.sharding import parse_mesh
    from dspark_jax.scheduler.costs import CostTableError

    try:
        sampling = SamplingParams(args.temperature, args.top_k, args.top_p)
        convs = read_prompts(args.prompts)
        table, sts = scheduling_inputs(args, sampling)
        # traces for calibration verify every draft (calibrate reads full-gamma rounds)
        policy = "fixed" if args.traces and args.policy == "auto" else args.policy
        mesh = parse_mesh(args.mesh)
        target, drafter, mode = load_models(resolve_target_dir(args.target), args.drafter, args.mode, args.dtype, mesh)
        res, ids, texts = engine_texts.generate_texts(
            target, drafter, convs, max_new_tokens=args.max_new_tokens, batch=args.batch, max_len=args.max_len,
            gamma=args.gamma, policy=policy, threshold=args.threshold, sampling=sampling, seed=args.seed,
            loop=args.loop, traces=bool(args.traces), table=table, sts=sts, theta=args.theta, cost=args.cost_model,
            skip_drafting=args.skip_drafting, probe_every=args.probe_every, probe_max=args.probe_max,
            mesh=mesh, kv_pages=args.kv_pages, prefill_chunk=prefill_chunk(args.prefill_chunk))
    except (ValueError, FileNotFoundError, TargetMismatchError, EngineError, CostTableError,
            CalibrationMissingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, (r, text) in enumerate(zip(res.results, texts)):
        stats = {"request": i, "prompt_tokens": len(ids[i]), "new_tokens": len(r.tokens), "rounds": r.rounds,
                 "tau": round(r.tau, 3), "tokens_per_s": round(r.tokens_per_s, 1),
                 "finish_reason": r.finish_reason}
        if args.json:
            print(json.dumps({**stats, "completion": text}))
        else:
            print(f"=== request {i} ===\n{text}\n--- {json.dumps(stats)}")
    if args.traces and res.traces is not None:
        engine_texts.save_run_traces(Path(args.traces), res.traces, mode, sampling)
    print(json.dumps({"mode": mode, "policy": res.extra.get("policy"), "cost_table": res.extra.get("cost_table"),
                      "requests": len(res.results), "tau": round(res.tau, 3),
                      "tokens_per_s": round(res.tokens_per_s, 1), "seconds": round(res.seconds, 2),
                      "round_calls": res.round_calls}), file=sys.stderr if args.json else sys.stdout)
    return 0
