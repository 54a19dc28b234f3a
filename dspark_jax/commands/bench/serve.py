"""`python -m dspark_jax bench serve`: the server under load, configurations in turn at each level
of a fixed-concurrency sweep; total throughput against per-user speed (the paper's Pareto view), time
to first token and inter-token latency.

    python -m dspark_jax bench serve --target DIR --drafter dspark=DIR --drafter dflash=DIR \\
        --prompts ../shared/eval_datasets/mt-bench.jsonl --concurrency 1 2 4 8 16 32 --out bench_serve

Every configuration runs in this process behind a real HTTP server on 127.0.0.1 (the same app as
`python -m dspark_jax serve`), all of them up at once: each concurrency level runs every
configuration in turn, so a drift of a noisy machine hits them alike. Clients are threads
streaming chat completions through the `openai` client, bounded by --requests per level and
--max-seconds per level.

With --repeats N every level runs each configuration N times, the order reversed on alternate
repeats (A B C, C B A, A B C, ...). A level's figures are then the medians over its runs (its
counts the totals), and a drafter's ratio to target-only is the median of the ratios taken within
each repeat, printed with their range: one slow run of a shared machine moves the median little.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np


def _one(client, model, messages, max_tokens, temperature):
    t0 = time.perf_counter()
    stamps, n = [], 0
    stream = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                            temperature=temperature, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter() - t0)
        if getattr(chunk, "usage", None):
            n = chunk.usage.completion_tokens
    end = time.perf_counter() - t0
    return {"ttft": stamps[0] if stamps else end, "itl": list(np.diff(stamps)), "tokens": n, "seconds": end}


def run_level(client, model, prompts, concurrency: int, requests: int, max_seconds: float, max_tokens: int,
              temperature: float) -> dict:
    """`requests` requests from `concurrency` clients (each sends its next when one finishes)."""
    out, lock = [], threading.Lock()
    deadline = time.perf_counter() + max_seconds
    counter = iter(range(requests))

    def client_loop(_):
        while time.perf_counter() < deadline:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            r = _one(client, model, prompts[i % len(prompts)], max_tokens, temperature)
            with lock:
                out.append(r)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(client_loop, range(concurrency)))
    wall = time.perf_counter() - t0
    toks = sum(r["tokens"] for r in out)
    itl = [x for r in out for x in r["itl"]]
    pct = lambda v, q: float(np.percentile(v, q)) if len(v) else float("nan")
    return {"concurrency": concurrency, "requests": len(out), "seconds": wall, "tokens": toks,
            "throughput": toks / wall if wall > 0 else 0.0,
            "per_user": float(np.mean([r["tokens"] / r["seconds"] for r in out if r["seconds"] > 0])) if out else 0.0,
            "ttft_p50": pct([r["ttft"] for r in out], 50), "ttft_p99": pct([r["ttft"] for r in out], 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99)}


def round_counts(metrics) -> dict:
    """The server's rounds so far, from its /metrics counters: all of them, those that skipped
    drafting, and their wall seconds (a level's are the difference across it)."""
    if metrics is None:
        return {"rounds": 0, "skipped_rounds": 0, "round_seconds": 0.0}
    reg = metrics.registry
    rounds = sum(x.value for m in reg.collect() if m.name == "dspark_rounds" for x in m.samples
                 if x.name == "dspark_rounds_total")
    return {"rounds": int(rounds), "skipped_rounds": int(reg.get_sample_value("dspark_skipped_rounds_total") or 0),
            "round_seconds": float(reg.get_sample_value("dspark_round_seconds_sum") or 0.0)}


COUNTS = ("requests", "tokens", "seconds", "rounds", "skipped_rounds", "round_seconds")


def summarise(runs: list[dict]) -> dict:
    """A level's runs (one per repeat) as one level: medians of the rates and latencies, totals of
    the counts, and the runs themselves under "repeats" when there are several."""
    if len(runs) == 1:
        return runs[0]
    level = {k: (sum(r[k] for r in runs) if k in COUNTS else float(np.median([r[k] for r in runs])))
             for k in runs[0] if k != "concurrency"}
    return {"concurrency": runs[0]["concurrency"], **level, "repeats": runs}


def paired_ratios(runs: list[dict], base_runs: list[dict]) -> list[float]:
    """Throughput over target-only's within each repeat (the two ran minutes apart at most)."""
    return [r["throughput"] / b["throughput"] if b["throughput"] > 0 else float("nan")
            for r, b in zip(runs, base_runs, strict=True)]


def in_turn(running: list, repeat: int) -> list:
    """The configurations in this repeat's order: reversed on odd repeats, so a drift that is linear
    over two repeats costs every configuration alike."""
    return running if repeat % 2 == 0 else running[::-1]


def warm_up(client, served, prompts, temperature) -> None:
    """One short request per prefill bucket the prompts fall in, so no compilation is timed."""
    from dspark_jax.text.chat import render_prompt

    eng = served.loop.engine
    by_bucket = {}
    for p in prompts:
        n = len(render_prompt(served.tokenizer, p, served.chat_template))
        by_bucket.setdefault(next((b for b in eng.prefill_buckets if b >= n), None), p)
    for p in by_bucket.values():
        _one(client, served.model, p, 2, temperature)


def load_prompts(path: str | None, n: int) -> list[list[dict]]:
    from dspark_jax.data.formats import read_conversations

    if path:
        convs = read_conversations(path)
    else:
        from dspark_jax.data.corpora import build_corpus

        convs = build_corpus("heldout", 0, n_code=n, n_math=n, n_prose=n)
    out = []
    for c in convs[: max(n, 1)]:
        first = next((m for m in c if m.get("role") == "user"), c[0])
        out.append([{"role": "user", "content": first["content"]}])
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for name, levels in results.items():
        ax.plot([lv["per_user"] for lv in levels], [lv["throughput"] for lv in levels], "o-", label=name)
        for lv in levels:
            ax.annotate(str(lv["concurrency"]), (lv["per_user"], lv["throughput"]), fontsize=7)
    ax.set_xlabel("per-user tokens/s")
    ax.set_ylabel("total tokens/s")
    ax.set_title("throughput vs per-user speed (labels: concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)



SCHEDULED_POLICIES = ("static", "production", "early_stop")  # engine.policy.SCHEDULED


def parse_config(spec: str, default_policy: str) -> tuple[str, str, str]:
    """'NAME=DIR[@POLICY]' (or a bare DIR) -> (name, drafter dir, policy)."""
    name, _, rest = spec.partition("=") if "=" in spec else ("", "", spec)
    path, _, policy = rest.partition("@")
    return (name or Path(path).name), path, (policy or default_policy)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench serve", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--target", default=None, help="HF checkpoint directory (default: the embedded target)")
    ap.add_argument("--drafter", action="append", default=[], metavar="NAME=DIR[@POLICY]",
                    help="a drafter configuration (repeat), with its own verification policy after @ (e.g. "
                         "dspark-sched=DIR@production); target-only always runs first")
    ap.add_argument("--policy", default="auto",
                    help="verification policy of configurations without @POLICY (default auto: the drafter kind's, "
                         "as `serve` runs it)")
    ap.add_argument("--costs", default=None,
                    help="cost table for configurations with an explicit scheduled @POLICY (auto ones, and "
                         "scheduled ones without it, measure their own)")
    ap.add_argument("--calibrated", action="store_true",
                    help="scheduled configurations use the drafter's STS temperatures fitted at --temperature "
                         "(default: auto configurations use a stored fit at temperature 1 where there is one)")
    ap.add_argument("--skip-drafting", nargs="?", const="known", default=False,
                    choices=("known", "acceptance", "best_case"),
                    help="scheduled configurations with an explicit @POLICY skip the drafter where the cost table "
                         "says it does not pay")
    ap.add_argument("--prompts", default=None, help="prompt set jsonl ({\"turns\": [...]}), first user turn of each")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 2 x concurrency, >= 8)")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="per level: no new request after this")
    ap.add_argument("--max-new-tokens", "--max-tokens", dest="max_tokens", type=int, default=64,
                    help="per request (the OpenAI max_tokens; default 64)")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of each configuration per level, in alternating order; figures are medians "
                         "and ratios the median of each repeat's (default 1)")
    ap.add_argument("--slots", type=int, default=None, help="engine slots (default: the largest concurrency)")
    ap.add_argument("--max-len", type=int, default=1024)
    from dspark_jax.cli import add_kv_pages_argument, add_prefill_chunk_argument
    from dspark_jax.serve.defaults import SERVE_PREFILL_CHUNK

    add_kv_pages_argument(ap)
    add_prefill_chunk_argument(ap, SERVE_PREFILL_CHUNK)
    ap.add_argument("--out", default="bench_serve", help="results.json and pareto.png go here")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1 (got {args.repeats}): the number of runs of each configuration "
                 "per level")
    return args


def _print_level(name: str, lv: dict, which: str) -> None:
    print(f"[bench serve] {name:<12} c={lv['concurrency']:<3}{which} {lv['requests']:>4} req  "
          f"{lv['throughput']:8.1f} tok/s total {lv['per_user']:7.1f} tok/s/user  TTFT p50 "
          f"{lv['ttft_p50'] * 1e3:7.0f} ms p99 {lv['ttft_p99'] * 1e3:7.0f} ms  ITL p50 {lv['itl_p50'] * 1e3:6.1f} ms "
          f"p99 {lv['itl_p99'] * 1e3:6.1f} ms  rounds {lv['rounds']} ({lv['skipped_rounds']} skipped drafting)",
          flush=True)


READY_TIMEOUT_S = 3600  # a server's start (compiles, its own cost table, the warm-up)


def start_record(seconds: float, own) -> dict:
    """A server's start: seconds from `build` to ready, and its own cost table (engine/own_costs.py:
    measured now or read back; the seconds of timing apart from the first calls, which compile the
    programs serving needs anyway), so the table's share of a start reads off one run."""
    rec = {"seconds": round(seconds, 2), "cost_table": None}
    if own is not None:
        rec["cost_table"] = {"source": own.source, "repeats": own.repeats,
                             "timing_seconds": round(own.timing_seconds, 2),
                             "first_calls_seconds": round(own.first_calls, 2)}
    return rec


def describe_start(rec: dict) -> str:
    t = rec["cost_table"]
    if t is None:
        return f"ready in {rec['seconds']:.1f} s"
    if t["source"] != "measured":
        return f"ready in {rec['seconds']:.1f} s (own cost table {t['source']})"
    share = t["timing_seconds"] / rec["seconds"]
    return (f"ready in {rec['seconds']:.1f} s, of which {t['timing_seconds']:.1f} s ({share:.0%}) timing its own cost "
            f"table ({t['repeats']} sweeps, after {t['first_calls_seconds']:.1f} s in the first calls, which compile)")


def main(argv=None) -> int:
    args = parse_args(argv)
    import openai

    from dspark_jax.cli import prefill_chunk
    from dspark_jax.serve import build, serve_in_thread

    prompts = load_prompts(args.prompts, args.num_prompts)
    configs = [("target-only", "none", None)] + [parse_config(s, args.policy) for s in args.drafter]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {}
    peak_pages: dict = {}
    compiled_while_timed: dict = {}  # per configuration: executables compiled inside the timed levels
    slots = args.slots or max(args.concurrency)
    # every configuration's server is up at once: the levels alternate between them
    running, clients, about, starts = [], {}, {}, {}
    try:
        for name, drafter, policy in configs:
            scheduled = policy in SCHEDULED_POLICIES or policy == "auto"
            kw = {} if drafter == "none" else dict(
                policy=policy, costs=args.costs if policy in SCHEDULED_POLICIES else None,
                calibrated=(args.temperature if args.calibrated and scheduled
                            else "auto" if policy == "auto" else None),
                skip_drafting="auto" if policy == "auto" else args.skip_drafting if scheduled else False)
            # the server's own warm-up (as `serve` runs it): every round program a skip rule may
            # choose is compiled before the levels are timed, not when serving first reaches it
            t0 = time.perf_counter()
            app, served = build(args.target, drafter, slots=slots, max_len=args.max_len,
                                max_queue=max(4 * slots, max(args.concurrency)), warmup=True,
                                kv_pages=args.kv_pages, prefill_chunk=prefill_chunk(args.prefill_chunk), **kw)
            server, thread, port = serve_in_thread(app)
            running.append((name, served, server, thread))
            if not served.loop.ready.wait(READY_TIMEOUT_S) or served.loop.error is not None:
                raise RuntimeError(f"the {name} server did not get ready: {served.loop.error!r}")
            starts[name] = start_record(time.perf_counter() - t0, served.loop.engine.own_table)
            about[name] = served.about["policy"]
            clients[name] = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
            warm_up(clients[name], served, prompts, args.temperature)
            results[name] = []
            print(f"[bench serve] {name}: policy {served.about['policy']}; "
                  f"cost table {served.loop.engine.table_source}; {describe_start(starts[name])}", flush=True)
        # one level at a time, each configuration in turn: drifts of a noisy machine hit all of them
        compiled_before = {name: served.loop.engine.compiled_programs() for name, served, _, _ in running}
        for c in args.concurrency:
            runs = {name: [] for name, _, _, _ in running}
            for repeat in range(args.repeats):
                for name, served, _, _ in in_turn(running, repeat):
                    before = round_counts(served.metrics)
                    lv = run_level(clients[name], served.model, prompts, c, args.requests or max(2 * c, 8),
                                   args.max_seconds, args.max_tokens, args.temperature)
                    lv.update({k: v - before[k] for k, v in round_counts(served.metrics).items()})
                    runs[name].append(lv)
                    _print_level(name, lv, f" run {repeat + 1}/{args.repeats}" if args.repeats > 1 else "")
            for name, level_runs in runs.items():
                results[name].append(summarise(level_runs))
                if name != "target-only":
                    ratios = paired_ratios(level_runs, runs["target-only"])
                    results[name][-1].update(ratio=float(np.median(ratios)), ratios=ratios)
        for name, served, _, _ in running:
            compiled_while_timed[name] = served.loop.engine.compiled_programs() - compiled_before[name]
            if compiled_while_timed[name]:
                print(f"[bench serve] {name}: {compiled_while_timed[name]} program(s) compiled inside the timed "
                      "levels: its rows include compile time", flush=True)
    finally:
        for name, served, server, thread in running:
            server.should_exit = True
            thread.join(60)
            served.loop.stop()
            if served.loop.engine.pages is not None:
                peak_pages[name] = served.loop.engine.pages.peak
    for name, levels in results.items():
        if name != "target-only":
            print(f"[bench serve] {name} / target-only throughput: " + ", ".join(
                f"c={lv['concurrency']}: {lv['ratio']:.2f}x" + (
                    f" ({min(lv['ratios']):.2f}-{max(lv['ratios']):.2f} over {len(lv['ratios'])} repeats)"
                    if len(lv["ratios"]) > 1 else "") for lv in levels))
    meta = {"command": "python -m dspark_jax bench serve " + " ".join(sys.argv[2:] if argv is None else argv),
            "prompts": args.prompts, "max_tokens": args.max_tokens, "repeats": args.repeats,
            "temperature": args.temperature, "slots": slots,
            "configs": {name: {"drafter": d, "policy": pol, "scheduling": about.get(name),
                               "calibrated": bool(args.calibrated and pol in SCHEDULED_POLICIES),
                               "start": starts.get(name)}
                        for name, d, pol in configs},
            "kv_pages": args.kv_pages, "prefill_chunk": args.prefill_chunk or None, "peak_pages": peak_pages or None,
            "compiled_while_timed": compiled_while_timed}
    (out / "results.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    plot(results, out / "pareto.png")
    print(f"[bench serve] {out / 'results.json'}, {out / 'pareto.png'}")
    return 0
