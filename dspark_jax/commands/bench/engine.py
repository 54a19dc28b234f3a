"""`python -m dspark_jax bench engine`: engine throughput, accepted length and sequential-head overhead.

    python -m dspark_jax bench engine --target DIR --drafter runs/dspark/drafter [--dflash DIR] \
        [--prompts heldout.jsonl] [--sections loop,speed,tau,head]

Sections (all ratios measured in one run):
- loop: host loop over the compiled round vs one compiled lax.while_loop (target-only and DSpark).
- speed: tokens/s of the --drafter (any kind) vs target-only at batch 1 and 8 and --temperature (median and
  range over --repeats runs, the two alternating), beside the bound tau * T_ar / (T_draft + T_verify) from
  separately timed parts; with `--costs R=TABLE` also scheduled DSpark at batch R (production policy,
  skip rule, STS with --calibrated), alternating with the other two; `--dtype bfloat16` for bf16 weights.
- tau: accepted length (gamma = block size, T = 1) per given drafter with a 95 % bootstrap
  interval over prompts.
- head: a full round with the Markov head vs without (same backbone), gamma 7 and 15,
  batch 1 and 32, beside the analytic FLOP share at these shapes and at Qwen3-8B shapes.
- join: a --join-tokens prompt joins while 3 requests decode: the running requests' longest wait
  for a token (the stall) and the joiner's time to its first token, prefilled whole vs forwarded
  in chunks of --prefill-chunk tokens inside the rounds (not in the default sections).
- skip: a round of the speculative engine that skips drafting (the skip rule) against a target-only
  step, 4 slots decoding: the scheduled engine's price for not speculating (not in the defaults).
Without --drafter a random drafter is used (speed / tau then only measure the machinery).
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.calibration.calibrate import load_temperatures
from dspark_jax.cli import add_dtype_argument
from dspark_jax.drafter import registry
from dspark_jax.drafter.kinds.block import DFLASH, DSPARK
from dspark_jax.engine.batcher import Batcher, Job
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.engine import Engine


def _args(argv):
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench engine")
    ap.add_argument("--target", default=None, help="HF checkpoint dir (default: the embedded target)")
    ap.add_argument("--drafter", default=None, help="trained DSpark drafter dir")
    ap.add_argument("--dflash", default=None, help="trained DFlash drafter dir (tau comparison)")
    ap.add_argument("--eagle3", default=None, help="trained Eagle3 drafter dir (tau comparison)")
    ap.add_argument("--mtp1", default=None, help="trained MTP-1 drafter dir (tau comparison)")
    ap.add_argument("--prompts", default=None, help="held-out prompts jsonl (default: embedded math held-out)")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--sections", default="loop,speed,tau,head")
    ap.add_argument("--repeats", dest="reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the speed section "
                    "(0 = greedy; default 1)")
    ap.add_argument("--join-tokens", type=int, default=512, help="join section: the joining prompt's length")
    ap.add_argument("--prefill-chunk", type=int, default=64, help="join section: prompt tokens per round")
    ap.add_argument("--batch-sizes", default="1,8", help="speed section: the batch sizes timed (default 1,8)")
    ap.add_argument("--costs", action="append", default=[], metavar="R=TABLE",
                    help="speed section: also time scheduled DSpark at batch R (the production policy, the skip "
                         "rule, this cost table measured for R slots: `python -m dspark_jax costs measure --slots R`); "
                         "repeat per batch size")
    ap.add_argument("--calibrated", action="store_true",
                    help="scheduled rows use the drafter's STS temperatures fitted at --temperature")
    add_dtype_argument(ap)
    ap.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = ap.parse_args(argv)
    if args.calibrated and not args.drafter:
        ap.error("--calibrated reads the STS fit stored with a trained drafter: give --drafter DIR")
    try:
        args.tables = _tables(args.costs)
    except ValueError as e:
        ap.error(str(e))
    unused = sorted(set(args.tables) - {int(b) for b in args.batch_sizes.split(",")})
    if unused:
        ap.error(f"--costs for batch size(s) {unused} that --batch-sizes {args.batch_sizes} does not time")
    return args


def _tables(specs) -> dict:
    """`R=TABLE` flags -> {R: cost table}, each checked as the engine will use it."""
    from dspark_jax.parallel.platform import platform
    from dspark_jax.scheduler.costs import load_cost_table

    out = {}
    for spec in specs:
        r, sep, path = spec.partition("=")
        if not sep or not r.isdigit() or int(r) < 1:
            raise ValueError(f"--costs {spec!r}: give R=TABLE, the batch size (one of --batch-sizes) the table was "
                             "measured for, e.g. --costs 8=configs/costs/cpu_r8.json")
        out[int(r)] = load_cost_table(path, expect_backend=platform())
    return out


def _time(fn, reps):
    jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def _prompts(target, args):
    from dspark_jax.text.chat import render_prompt

    tok = target.require_tokenizer()
    if args.prompts:
        from dspark_jax.data.formats import read_conversations

        convs = read_conversations(args.prompts)
    else:
        from dspark_jax.data.corpora import math_conversations

        convs = [[c[0]] for c in math_conversations("heldout", seed=args.seed, n=args.num_prompts)]
    return [render_prompt(tok, c, target.chat_template) for c in convs[: args.num_prompts]], tok


def _random_drafter(target, gamma, markov_rank, seed=0):
    from flax import nnx

    from dspark_jax.config import DrafterSection
    from dspark_jax.drafter.frozen import attach_target
    from dspark_jax.parallel.sharding import create_model

    tok = target.tokenizer
    L = target.cfg.num_layers
    dcfg = DrafterSection(kind=(DSPARK if markov_rank else DFLASH).name, num_layers=2, gamma=gamma,
                          target_layer_ids=tuple(sorted({1, L // 2, L - 2})), markov_rank=markov_rank,
                          mask_token_id=(tok.mask_id if tok is not None and tok.mask_id is not None
                                         else target.cfg.vocab_size - 1))
    d = create_model(lambda: registry.build(target.cfg, dcfg, rngs=nnx.Rngs(seed)))
    attach_target(d, target.model)
    return d


def _parts(eng, st, ctl):
    """Separately jitted draft and verify of the engine's round (full bucket), for the bound."""
    from dspark_jax.engine.verify import verify_packed

    spec = eng.spec
    t_draft = _time(lambda: eng.draft(st, ctl), 5) if spec.G else 0.0
    toks = jnp.zeros((eng.R, spec.G + 1), jnp.int32)
    valid = jnp.broadcast_to(st.active[:, None], toks.shape)
    fv = jax.jit(lambda tp, c: verify_packed(tp, spec.tcfg, c, toks, st.pos, valid, bucket=spec.buckets[-1],
                                             feature_layers=spec.feature_layers).logits)
    return t_draft, _time(lambda: fv(eng.tp, st.cache), 5)


def _started(eng, prompts, max_new):
    st = eng.init_state()
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), eng.R)))
    ps = [prompts[i % len(prompts)] for i in range(eng.R)]
    return eng.prefill_slots(st, list(range(eng.R)), ps, kd, [max_new] * eng.R)


def bench_loop(target, drafter, prompts, args, out):
    from dspark_jax.decoding.sampling import SamplingParams

    S = max(len(p) for p in prompts[:8]) + args.max_new_tokens + drafter.gamma + 2
    for name, d in (("ar", None), ("dspark", drafter)):
        eng = Engine(target, d, EngineConfig(num_slots=8, max_len=S, policy="fixed"))
        r = {}
        for loop in ("host", "while"):
            eng.generate(prompts[:8], max_new_tokens=4, sampling=SamplingParams(1.0, 0, 1.0), loop=loop)  # compile
            res = eng.generate(prompts[:8], max_new_tokens=args.max_new_tokens, sampling=SamplingParams(1.0, 0, 1.0),
                               loop=loop)
            r[loop] = res.tokens_per_s
        out[f"loop_{name}"] = {"host_tok_s": r["host"], "while_tok_s": r["while"],
                               "while_over_host": r["while"] / r["host"]}
        print(f"[loop] {name}: host {r['host']:.1f} tok/s, while {r['while']:.1f} tok/s, "
              f"ratio {r['while'] / r['host']:.3f}")


def bench_speed(target, drafter, prompts, args, out):
    from dspark_jax.decoding.sampling import SamplingParams

    sp = SamplingParams(args.temperature, 0, 1.0)
    name = registry.kind_of(drafter).name
    for R in (int(b) for b in args.batch_sizes.split(",")):
        ps = prompts[: max(R, 8)]
        S = max(len(p) for p in ps) + args.max_new_tokens + drafter.gamma + 2
        ar = Engine(target, None, EngineConfig(num_slots=R, max_len=S))
        ds = Engine(target, drafter, EngineConfig(num_slots=R, max_len=S, buckets=(R * (drafter.gamma + 1),),
                                                     policy="fixed"))
        engines = [(ar, {}), (ds, {})]
        table = args.tables.get(R)
        if table is not None:  # scheduled: the production policy + skip rule on the table measured for R slots
            sts = load_temperatures(args.drafter, sp) if args.calibrated else None
            sc = Engine(target, drafter, EngineConfig(num_slots=R, max_len=S, policy="production",
                                                      skip_drafting="known"), table=table)
            engines.append((sc, {"sts": sts}))
        for e, kw in engines:
            e.generate(ps[:R], max_new_tokens=4, sampling=sp, loop="while", **kw)
        runs, results = [], []  # the engines alternating, so drifts of this noisy machine hit all alike
        for _ in range(max(args.reps, 1)):
            res = [e.generate(ps, max_new_tokens=args.max_new_tokens, sampling=sp, loop="while", **kw)
                   for e, kw in engines]
            runs.append([r.tokens_per_s for r in res])
            results.append(res)
        rd = results[-1][1]
        runs = np.asarray(runs)
        ratios = runs[:, 1] / runs[:, 0]
        ctl = ds.control(sp)
        t_draft, t_verify = _parts(ds, _started(ds, ps, args.max_new_tokens), ctl)
        _, t_ar = _parts(ar, _started(ar, ps, args.max_new_tokens), ar.control(sp))
        bound = rd.tau * t_ar / (t_draft + t_verify)
        rng = lambda a: [float(a.min()), float(a.max())]
        rec = {"batch": R, "temperature": args.temperature, "drafter": name, "repeats": len(runs),
               "ar_tok_s": float(np.median(runs[:, 0])), "ar_tok_s_range": rng(runs[:, 0]),
               "spec_tok_s": float(np.median(runs[:, 1])), "spec_tok_s_range": rng(runs[:, 1]),
               "speedup": float(np.median(ratios)), "speedup_range": rng(ratios), "tau": rd.tau, "T_ar_ms": 1e3 * t_ar,
               "T_draft_ms": 1e3 * t_draft, "T_verify_ms": 1e3 * t_verify, "bound": bound}
        if table is not None:
            sr = runs[:, 2] / runs[:, 0]
            rec.update(scheduled_tok_s=float(np.median(runs[:, 2])), scheduled_tok_s_range=rng(runs[:, 2]),
                       scheduled_speedup=float(np.median(sr)), scheduled_speedup_range=rng(sr),
                       scheduled_tau=results[-1][2].tau, scheduled_calibrated=bool(args.calibrated))
            print(f"[speed] batch {R}, T {args.temperature:g}: scheduled {name} {rec['scheduled_tok_s']:.1f} tok/s "
                  f"(x{rec['scheduled_speedup']:.2f}, x{sr.min():.2f}-{sr.max():.2f}); tau {rec['scheduled_tau']:.2f}"
                  f"{', STS' if args.calibrated else ''}")
        out[f"speed_b{R}"] = rec
        print(f"[speed] batch {R}, T {args.temperature:g}: AR {rec['ar_tok_s']:.1f} tok/s, "
              f"{name} {rec['spec_tok_s']:.1f} "
              f"tok/s (x{rec['speedup']:.2f}, x{ratios.min():.2f}-{ratios.max():.2f} "
              f"over {len(runs)} runs); tau {rd.tau:.2f}, "
              f"T_ar {1e3 * t_ar:.2f} ms, T_draft {1e3 * t_draft:.2f} ms, "
              f"T_verify {1e3 * t_verify:.2f} ms -> bound x{bound:.2f}")


def bench_tau(target, drafters, prompts, args, out, stop_ids):
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.eval.metrics import bootstrap_tau

    for name, d in drafters.items():
        gamma = getattr(d, "gamma", None) or d.dcfg.gamma
        S = max(len(p) for p in prompts) + args.max_new_tokens + gamma + 2
        eng = Engine(target, d, EngineConfig(num_slots=8, max_len=S, policy="fixed"))
        res = eng.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=SamplingParams(1.0, 0, 1.0),
                           loop="while", stop_ids=stop_ids, seed=args.seed)
        _, lo, hi = bootstrap_tau([r.accepted for r in res.results], [r.rounds for r in res.results])
        out[f"tau_{name}"] = {"tau": res.tau, "ci95": [lo, hi], "prompts": len(prompts)}
        print(f"[tau] {name}: {res.tau:.3f} (95% CI {lo:.3f}-{hi:.3f}) over {len(prompts)} prompts")


def head_flop_share(H, V, r, G, L_draft, L_target, I_draft, I_target, R, S_ctx):
    """Analytic FLOP share of the Markov head in a round (draft + verify), matmul FLOPs only."""
    head = R * G * 2 * r * V  # W2 projection (r -> V) per slot; the W1 lookup is a gather
    layer = lambda I, T: 2 * T * (4 * H * H + 3 * H * I) + 4 * T * S_ctx * H
    draft = R * G * 2 * H * V + L_draft * layer(I_draft, R * G) + R * 2 * H * H
    verify = L_target * layer(I_target, R * (G + 1)) + R * (G + 1) * 2 * H * V
    return head / (draft + verify + head)


def bench_head(target, prompts, args, out):
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine.round import round_step

    cfg = target.cfg
    sp = SamplingParams(1.0, 0, 1.0)
    S = max(len(p) for p in prompts[:32]) + 32
    for G in (7, 15):
        with_h, without = _random_drafter(target, G, 256), _random_drafter(target, G, 0)
        for R in (1, 32):
            ps = [prompts[i % len(prompts)] for i in range(R)]
            times = {}
            for name, d in (("markov", with_h), ("none", without)):
                config = EngineConfig(num_slots=R, max_len=S + G, buckets=(R * (G + 1),), policy="fixed")
                eng = Engine(target, d, config)
                st = _started(eng, ps, 16)
                ctl = eng.control(sp)
                rnd = jax.jit(lambda tp, dp, st, ctl, _e=eng: round_step(_e.spec, tp, dp, st, ctl)[1])
                times[name] = _time(lambda: rnd(eng.tp, eng.dp, st, ctl), args.reps)
            meas = times["markov"] / times["none"] - 1
            ctx = int(np.mean([len(p) for p in ps]))
            ana = head_flop_share(cfg.hidden_size, cfg.vocab_size, 256, G, 2, cfg.num_layers, cfg.intermediate_size,
                                  cfg.intermediate_size, R, ctx)
            q8 = head_flop_share(4096, 151936, 256, G, 5, 36, 12288, 12288, R, 1024)
            out[f"head_g{G}_b{R}"] = {"measured_overhead": meas, "analytic_share": ana, "qwen3_8b_share": q8,
                                      "round_ms_markov": 1e3 * times["markov"], "round_ms_none": 1e3 * times["none"]}
            print(f"[head] gamma {G} batch {R}: round {1e3 * times['none']:.2f} -> {1e3 * times['markov']:.2f} ms "
                  f"(+{100 * meas:.1f} %), analytic FLOP share {100 * ana:.1f} %, Qwen3-8B shapes {100 * q8:.2f} %")


def _join_once(eng, shorts, long, max_new, sp):
    """3 requests decode; `long` joins slot 3 -> (longest gap in s between rounds that gave the
    running requests tokens, counted from before the join; joiner's seconds to its first token;
    rounds until then; median seconds of a round before the join, when no slot prefills)."""
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), eng.R)))
    b = Batcher(eng, eng.control(sp))
    jobs = [Job(prompt=p, max_new=max_new, sampling=sp, key_data=kd[i]) for i, p in enumerate(shorts)]
    b.join(b.admit(collections.deque(jobs))[0])
    plain = [b.round().seconds for _ in range(4)]
    t0 = last = time.perf_counter()
    joiner = Job(prompt=long, max_new=max_new, sampling=sp, key_data=kd[3])
    b.join(b.admit(collections.deque([joiner]))[0])
    gap, rounds = 0.0, 0
    while True:
        rnd = b.round()
        now = time.perf_counter()
        rounds += 1
        if any(u.new and u.job is not joiner for u in rnd.updates):
            gap, last = max(gap, now - last), now
        if joiner.tokens:
            return gap, now - t0, rounds, float(np.median(plain[1:]))


def bench_join(target, drafter, prompts, args, out):
    from dspark_jax.decoding.sampling import SamplingParams

    long = [t for p in prompts for t in p][: args.join_tokens]
    shorts = [p[:64] for p in prompts[:3]]
    max_new, sp = 4 * args.max_new_tokens, SamplingParams(0.0, 0, 1.0)
    S = len(long) + max_new + drafter.gamma + 2
    res = {}
    for name, chunk in (("whole", None), ("chunked", args.prefill_chunk)):
        eng = Engine(target, drafter, EngineConfig(num_slots=4, max_len=S, prefill_chunk=chunk, policy="fixed"))
        _join_once(eng, shorts, long, max_new, sp)  # compiles
        runs = np.asarray([_join_once(eng, shorts, long, max_new, sp) for _ in range(args.reps)])
        res[name] = {"stall_ms": 1e3 * float(np.median(runs[:, 0])),
                     "joiner_ttft_ms": 1e3 * float(np.median(runs[:, 1])),
                     "rounds_to_first_token": int(np.median(runs[:, 2])),
                     "round_no_chunk_ms": 1e3 * float(np.median(runs[:, 3]))}
        print(f"[join] {name}: {len(long)}-token prompt joins 3 decoding requests: their longest wait for a token "
              f"{res[name]['stall_ms']:.0f} ms, the joiner's first token after {res[name]['joiner_ttft_ms']:.0f} ms "
              f"({res[name]['rounds_to_first_token']} rounds)")
    res["stall_ratio"] = res["chunked"]["stall_ms"] / res["whole"]["stall_ms"]
    res["ttft_ratio"] = res["chunked"]["joiner_ttft_ms"] / res["whole"]["joiner_ttft_ms"]
    res["no_chunk_round_ratio"] = res["chunked"]["round_no_chunk_ms"] / res["whole"]["round_no_chunk_ms"]
    print(f"[join] chunks of {args.prefill_chunk}: stall x{res['stall_ratio']:.2f}, joiner's first token "
          f"x{res['ttft_ratio']:.2f} of whole prefill; "
          f"a round with no prompt to forward x{res['no_chunk_round_ratio']:.2f} "
          f"({res['chunked']['round_no_chunk_ms']:.0f} vs {res['whole']['round_no_chunk_ms']:.0f} ms)")
    out["join"] = {"prompt_tokens": len(long), "prefill_chunk": args.prefill_chunk, **res}


def _round_times(eng, ctl, prompts, max_new, n):
    """(seconds of each of `n` rounds of `eng` with every slot decoding, after one untimed round;
    draft tokens they verified in all)."""
    st = _started(eng, prompts, max_new)
    st, _ = eng.step(st, ctl)
    ts, verified = [], 0
    for _ in range(n):
        t = time.perf_counter()
        st, ro = eng.step(st, ctl)
        jax.block_until_ready(st.n_gen)
        ts.append(time.perf_counter() - t)
        verified += int(np.asarray(ro.lengths).sum())  # after the clock: a host read of a finished round
    return ts, verified


def bench_skip(target, drafter, prompts, args, out):
    """A round of the speculative engine that skips drafting (the skip rule, on a table where no
    drafting ever pays) against a target-only step, both at 4 slots with every slot decoding:
    what the scheduled engine pays over plain decoding when it decides not to speculate."""
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.scheduler.prefix import make_table

    R, sp, n = 4, SamplingParams(0.0, 0, 1.0), max(args.reps, 1) * 8
    ps = prompts[:R]
    S = max(len(p) for p in ps) + args.max_new_tokens + drafter.gamma + 2
    max_new = max(args.max_new_tokens, 2 * n + 2)
    buckets = (R, 2 * R, R * (drafter.gamma + 1))
    never = make_table(buckets, t_verify=[0.1, 0.1, 0.1], t_draft=1e3)  # drafting never pays, even at best
    ar = Engine(target, None, EngineConfig(num_slots=R, max_len=S + 2 * n))
    sk = Engine(target, drafter, EngineConfig(num_slots=R, max_len=S + 2 * n, policy="production",
                                              skip_drafting="best_case", buckets=buckets), table=never)
    runs = {"target_only": [], "skipped": []}
    for _ in range(3):  # alternating, so drifts of this machine hit both
        runs["target_only"] += _round_times(ar, ar.control(sp), ps, max_new, n)[0]
        ts, verified = _round_times(sk, sk.control(sp), ps, max_new, n)
        assert verified == 0, "the skip rule drafted on a table where nothing pays"
        runs["skipped"] += ts
    med = {k: 1e3 * float(np.median(v)) for k, v in runs.items()}
    out["skip"] = {"slots": R, "rounds": len(runs["skipped"]), "target_only_ms": med["target_only"],
                   "skipped_round_ms": med["skipped"], "ratio": med["skipped"] / med["target_only"]}
    print(f"[skip] {R} slots decoding: a round that skips drafting {med['skipped']:.1f} ms, a target-only step "
          f"{med['target_only']:.1f} ms (x{out['skip']['ratio']:.2f}; medians over {len(runs['skipped'])} rounds each)")


def main(argv=None) -> int:
    args = _args(argv)
    from dspark_jax.embedded.target import resolve_target_dir
    from dspark_jax.io.drafter_dir import load as load_drafter
    from dspark_jax.io.loading import load_models

    target, drafter, _ = load_models(resolve_target_dir(args.target), args.drafter, None, args.dtype)
    prompts, tok = _prompts(target, args)
    sections = set(args.sections.split(","))
    drafter = drafter if drafter is not None else _random_drafter(target, 7, 256)
    out = {"target": str(target.path), "drafter": args.drafter or "<random>", "cpu_devices": jax.device_count(),
           "dtype": str(target.model.embed[...].dtype)}
    if "loop" in sections:
        bench_loop(target, drafter, prompts, args, out)
    if "speed" in sections:
        bench_speed(target, drafter, prompts, args, out)
    if "tau" in sections:
        ds = {DSPARK.name: drafter}
        for kind in (k for k in registry.KINDS if k != DSPARK.name):
            if getattr(args, kind, None):
                ds[kind] = load_drafter(getattr(args, kind), target)
        bench_tau(target, ds, prompts, args, out, tok.stop_ids)
    if "head" in sections:
        bench_head(target, prompts, args, out)
    if "join" in sections:
        bench_join(target, drafter, prompts, args, out)
    if "skip" in sections:
        bench_skip(target, drafter, prompts, args, out)
    print(json.dumps(out, indent=1, default=float))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=float))
    return 0
