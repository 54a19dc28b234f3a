"""Verification cost tables (docs/method.md §3.1): measure on the engine's compiled round, save, load, check.

    python -m dspark_jax costs measure --model tiny --num-slots 8 --gamma 3 --out configs/costs/cpu_tiny.json
    python -m dspark_jax costs roofline --out configs/costs/accelerator_synthetic.json   # synthetic, documented
    python -m dspark_jax costs show configs/costs/accelerator_synthetic.json

A cost file is JSON::

    {"format": "dspark_cost_table/1", "backend": "cpu", "device_kind": "cpu",
     "buckets": [8, 16, 32], "t_verify": [s, s, s],      # seconds per target verification step
     "t_draft": s,                                       # seconds of drafting per round (at num_slots)
     "draft_requests": [..], "t_draft_by_requests": [..],  # optional: draft time vs concurrency
     "t_draft_by_kind": {"mtp1": {"draft_requests": [..], "t_draft_by_requests": [..]}},  # optional
     "measured_on": "compiled_round",                    # measured tables: t_verify from the engine's round
     "t_round": [..], "plan": [..],                      # measured tables: whole-round times, (k, g) per bucket
     "provenance": "...", "engine": {...}, "measure": {...}}

The scheduler consumes it as a :class:`dspark_jax.scheduler.prefix.CostTable`. Loading checks that
times are positive and finite and, when asked, that the table was measured for the
expected backend and bucket set (a table from other hardware is fine for simulation, not
for scheduling a live engine).

Measurement (:func:`measure_engine`) times the engine's own compiled round (`Engine.step`)
once per bucket: the engine is built with :func:`verify_gamma_policy`, so k active slots
verifying g drafts each pack k * (1 + g) tokens and the round runs that bucket's branch of
its `lax.switch` (checked on `RoundOut.bucket`). The draft part is the engine's draft
function timed on the same state, alternating with the rounds; ``t_verify(b) = t_round(b) -
t_draft`` (the draft of the same time window). The core,
:func:`measure_table`, only needs ``round_fn(bucket) -> seconds`` and ``draft_fn() -> seconds``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from dspark_jax.cli import report_user_errors
from dspark_jax.drafter.registry import KINDS as KIND_NAMES
from dspark_jax.drafter.registry import get_kind
from dspark_jax.io.files import read_json
from dspark_jax.scheduler.prefix import CostTable, make_table

__all__ = ["CostTableError", "MeasureError", "FORMAT", "MEASURED_ON", "load_cost_file", "load_cost_table",
           "save_cost_file", "measure_table", "measure_engine", "engine_round_timer", "engine_draft_timer",
           "verify_gamma_policy", "bucket_plan", "draft_time", "time_call", "draft_time_at", "draft_time_for",
           "roofline_table", "roofline_time", "main"]

FORMAT = "dspark_cost_table/1"


class CostTableError(ValueError):
    pass


def _check(d: dict, where: str, expect_backend=None, expect_buckets=None) -> None:
    if d.get("format") != FORMAT:
        raise CostTableError(f"{where}: not a cost table (format {d.get('format')!r}, expected {FORMAT!r}); "
                             "write it with `python -m dspark_jax costs measure`")
    b, tv = d.get("buckets"), d.get("t_verify")
    if not isinstance(b, list) or not isinstance(tv, list) or len(b) != len(tv) or not b:
        raise CostTableError(f"{where}: 'buckets' and 't_verify' must be non-empty lists of equal length")
    bb = np.asarray(b)
    if not np.all(bb == np.round(bb)) or np.any(bb < 1) or np.any(np.diff(bb) <= 0):
        raise CostTableError(f"{where}: buckets must be positive integers in strictly increasing order, got {b}")
    times = {"t_verify": np.asarray(tv, np.float64), "t_draft": np.asarray([d.get("t_draft", math.nan)], np.float64)}
    if "t_draft_by_requests" in d:
        times["t_draft_by_requests"] = np.asarray(d["t_draft_by_requests"], np.float64)
        if len(d.get("draft_requests", [])) != len(d["t_draft_by_requests"]):
            raise CostTableError(f"{where}: draft_requests and t_draft_by_requests must have equal length")
    for name, t in times.items():
        bad = ~np.isfinite(t) | (t <= 0)
        if name == "t_draft":
            bad = ~np.isfinite(t) | (t < 0)  # 0 = drafting free (the paper's SPS form)
        if bad.any():
            raise CostTableError(f"{where}: {name} has non-positive or non-finite time(s) {t[bad].tolist()}: "
                                 "every step takes time; re-measure the table")
    if expect_backend is not None and d.get("backend") != expect_backend:
        raise CostTableError(f"{where}: measured on backend {d.get('backend')!r} ({d.get('device_kind')}), this run is "
                             f"on {expect_backend!r}: measure a table here with `python -m dspark_jax costs measure`")
    if expect_buckets is not None and [int(x) for x in b] != sorted(int(x) for x in expect_buckets):
        raise CostTableError(f"{where}: measured for buckets {[int(x) for x in b]}, the engine compiles "
                             f"{sorted(int(x) for x in expect_buckets)}: re-measure with these buckets")


def load_cost_file(path, expect_backend=None, expect_buckets=None) -> dict:
    """The checked JSON dict of a cost file."""
    path = Path(path)
    if not path.exists():
        raise CostTableError(f"cost table {path} does not exist")
    d = read_json(path, CostTableError)
    _check(d, str(path), expect_backend, expect_buckets)
    return d


def load_cost_table(path, expect_backend=None, expect_buckets=None, as_numpy=False) -> CostTable:
    """Load a cost file as the scheduler's CostTable (see module doc for the checks)."""
    d = load_cost_file(path, expect_backend, expect_buckets)
    return make_table(d["buckets"], t_verify=d["t_verify"], t_draft=d["t_draft"], as_numpy=as_numpy)


def draft_time_at(d: dict, n_requests: int) -> float:
    """Draft time per round at ``n_requests`` concurrent requests: interpolated from
    ``t_draft_by_requests`` when the file has it, else the scalar ``t_draft``."""
    if "t_draft_by_requests" in d:
        return float(np.interp(n_requests, d["draft_requests"], d["t_draft_by_requests"]))
    return float(d["t_draft"])


def save_cost_file(path, buckets, t_verify, t_draft, *, backend: str, device_kind: str, provenance: str,
                   **extra) -> Path:
    d = {"format": FORMAT, "backend": backend, "device_kind": device_kind,
         "buckets": [int(b) for b in buckets], "t_verify": [float(t) for t in t_verify], "t_draft": float(t_draft),
         "provenance": provenance, **extra}
    return _write_checked(path, d)


def _write_checked(path, d: dict) -> Path:
    """Check a cost dict as loading will, then write it as JSON (parents created)."""
    _check(d, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1))
    return path


# ------------------------------------------------------------------ measuring

MEASURED_ON = "compiled_round"
FLOOR_S = 1e-6  # t_verify floor (seconds) when the round minus the draft comes out non-positive (noise)


class MeasureError(ValueError):
    pass


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, stat: str = "median") -> float:
    """Seconds per call of ``fn`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return _stat(ts, stat)


def _stat(ts, stat: str) -> float:
    return float(np.median(ts) if stat == "median" else np.min(ts))


def measure_table(round_fn: Callable[[int], float], buckets, draft_fn: Callable[[], float] | None = None, *,
                  repeats: int = 5, warmup: int = 1, stat: str = "median", log=None, floor: float = FLOOR_S) -> dict:
    """-> {"buckets", "t_verify", "t_draft", "t_round", "t_draft_paired", "clipped"} from one-sample
    timers ``round_fn(bucket) -> seconds`` (one whole round landing in that bucket) and
    ``draft_fn() -> seconds`` (the round's draft part).

    Per bucket, draft and round calls alternate (after ``warmup`` untimed pairs), so both see
    the same load on a shared host; ``t_verify(b) = stat(rounds) - stat(drafts of that window)``
    and ``t_draft`` is ``stat`` over all draft samples. Everything in the round besides
    drafting (verification, sampling, rejection, rollback, drafter update) is thus charged to
    verification, and ``t_draft + t_verify(b)`` is the measured round (up to load drift between
    windows). A non-positive difference (noise when drafting dominates the round) is clipped to
    ``floor`` with a warning and listed in ``clipped``.
    """
    bs = sorted(int(x) for x in buckets)
    tr, tv, tdp, clipped, d_all = [], [], [], [], []
    for b in bs:
        for _ in range(warmup):
            if draft_fn is not None:
                draft_fn()
            round_fn(b)
        r, d = [], []
        for _ in range(repeats):
            if draft_fn is not None:
                d.append(float(draft_fn()))
            r.append(float(round_fn(b)))
        d_all += d
        tr.append(_stat(r, stat))
        tdp.append(_stat(d, stat) if d else 0.0)
        t = tr[-1] - tdp[-1]
        if not t > 0:
            clipped.append(b)
            msg = (f"bucket {b}: round {1e3 * tr[-1]:.3f} ms <= draft {1e3 * tdp[-1]:.3f} ms, so t_verify is clipped "
                   f"to {floor:g} s; timing noise dominates: re-measure on a quieter host or with more --repeats")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            if log:
                log("WARNING: " + msg)
            t = floor
        tv.append(t)
        if log:
            log(f"bucket {b:6d}: round {1e3 * tr[-1]:9.3f} ms  draft {1e3 * tdp[-1]:9.3f} ms  verify {1e3 * t:9.3f} ms")
    td = _stat(d_all, stat) if d_all else 0.0
    if log:
        log(f"draft per round: {1e3 * td:.3f} ms")
    return {"buckets": bs, "t_verify": tv, "t_draft": td, "t_round": tr, "t_draft_paired": tdp, "clipped": clipped}


def verify_gamma_policy(a, active, ctl, a_stale, stale_valid):
    """Measurement policy: every active slot verifies ``ctl.gamma`` drafts, so a round with k
    active slots packs exactly k * (1 + gamma) tokens and lands in a bucket chosen by (k, gamma)."""
    import jax.numpy as jnp

    return jnp.where(active, ctl.gamma, 0).astype(jnp.int32)


def bucket_plan(buckets, num_slots: int, gamma: int) -> dict[int, tuple[int, int]]:
    """``{bucket: (k, g)}``: k active slots verifying g drafts each (k * (1 + g) tokens) lands in
    ``bucket`` (the smallest bucket >= the token count). Picks the fullest count, then the most
    slots. Raises MeasureError naming every bucket no (k <= num_slots, g <= gamma) can reach."""
    bs = sorted(int(b) for b in buckets)
    R, G = int(num_slots), int(gamma)
    counts = sorted({(k * (1 + g), k, g) for k in range(1, R + 1) for g in range(G + 1)})
    plan, bad, lo = {}, [], 0
    for b in bs:
        hit = [c for c in counts if lo < c[0] <= b]
        if hit:
            plan[b] = hit[-1][1:]
        else:
            bad.append(b)
        lo = b
    if bad:
        raise MeasureError(
            f"cannot time bucket(s) {bad} on an engine with num_slots {R} and gamma {G}: a measured round packs "
            f"k active slots x (1 + g) tokens (k <= {R}, g <= {G}, at most {R * (G + 1)}), and no such count lies "
            "between the previous bucket (exclusive) and these; fix: drop them from --buckets or use buckets the "
            "engine reaches (e.g. multiples of num_slots up to num_slots * (gamma + 1)), or raise --num-slots")
    return plan


def _prefilled(engine, k: int, seed: int = 0):
    """The engine's state with requests in slots 0..k-1, their next round mid-cache."""
    import jax

    S, G, V = engine.S, engine.G, engine.target.cfg.vocab_size
    n = max(min(S // 2 - G, S - G - 2), 1 if engine.kind is None else engine.kind.min_prompt_len)
    prompts = [[(7 * i + 3 * j + 1) % V for j in range(n)] for i in range(k)]
    kd = jax.random.key_data(jax.random.split(jax.random.key(seed), k))
    return engine.prefill_slots(engine.init_state(), list(range(k)), prompts, kd, [S] * k)


def engine_draft_timer(engine, sampling=None):
    """``draft_fn() -> seconds`` (one call): the round's draft part, i.e. the engine's own draft
    function (`Engine.draft`: the call the compiled round makes first, jitted alone) on a state with all R
    slots prefilled. It drafts G tokens for every row whatever lengths the policy later picks, so
    one number per round is exact; timing it apart (rather than as the difference of two rounds)
    keeps it from absorbing the round's other bucket-independent work, which `measure_table`
    charges to verification instead (``t_draft + t_verify(b)`` stays the measured round). All
    inputs are traced arguments, as in the round: as closure constants XLA folds the per-row
    sampling branches and the draft times several times faster than inside the round."""
    if not engine.G:
        return lambda: 0.0
    import jax

    st, ctl = _prefilled(engine, engine.R), engine.control(sampling)

    def draft_fn() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(engine.draft(st, ctl))
        return time.perf_counter() - t0

    return draft_fn


def engine_round_timer(engine, sampling=None):
    """``(round_fn, plan, used)``: ``round_fn(bucket) -> seconds`` (one call) times the engine's
    compiled round (`Engine.step`, all buckets in one program) on a state with k active slots and
    fixed verify length g from `bucket_plan`, so the round runs its own `lax.switch` branch for
    that bucket. Each call starts from a fresh copy of the state (the round donates it; copying
    is not timed). ``used[bucket]`` records `RoundOut.bucket` of every call; a round that lands
    elsewhere raises MeasureError (the engine must be built with `verify_gamma_policy`)."""
    import jax
    import jax.numpy as jnp

    plan = bucket_plan(engine.priced_buckets, engine.R, engine.G)  # chunk-only buckets are never priced
    states, ctls, used = {}, {}, {}

    def round_fn(bucket: int) -> float:
        k, g = plan[bucket]
        if k not in states:
            states[k] = _prefilled(engine, k)
        if g not in ctls:
            ctls[g] = engine.control(sampling, gamma=g)
        s = jax.block_until_ready(jax.tree.map(jnp.copy, states[k]))
        t0 = time.perf_counter()
        out = jax.block_until_ready(engine.step(s, ctls[g]))
        dt = time.perf_counter() - t0
        got = int(out[1].bucket)
        used.setdefault(bucket, []).append(got)
        if got != engine.buckets.index(bucket):
            raise MeasureError(f"the round timed for bucket {bucket} ({k} active slots x (1 + {g}) tokens) ran in "
                               f"bucket {engine.buckets[got]}: the engine's policy {engine.policy_name!r} does not "
                               "verify ctl.gamma drafts per active slot; build the Engine with "
                               "policy=dspark_jax.scheduler.costs.verify_gamma_policy")
        return dt

    return round_fn, plan, used


def measure_engine(engine, repeats: int = 5, warmup: int = 1, stat: str = "median", sampling=None,
                   log=None) -> dict:
    """Cost table of ``engine`` (built with ``policy=verify_gamma_policy``) measured on its compiled
    round: `measure_table` over `engine_round_timer` and `engine_draft_timer`, plus the plan
    (active slots, verify length, tokens per bucket) and the bucket index every timed round used."""
    if warmup < 1 or repeats < 1:
        raise MeasureError(f"need warmup >= 1 (the first round compiles) and repeats >= 1, got {warmup}, {repeats}")
    round_fn, plan, used = engine_round_timer(engine, sampling)
    res = measure_table(round_fn, engine.priced_buckets, engine_draft_timer(engine, sampling), repeats=repeats, warmup=warmup, stat=stat, log=log)
    res["plan"] = [{"bucket": b, "active_slots": k, "verify_len": g, "tokens": k * (1 + g)}
                   for b, (k, g) in sorted(plan.items())]
    res["buckets_used"] = {b: used[b] for b in res["buckets"]}
    return res


def draft_time(engine, repeats: int = 5, warmup: int = 1, stat: str = "median", sampling=None) -> float:
    """Seconds of the engine's draft part per round (0 without a drafter); see `engine_draft_timer`."""
    f = engine_draft_timer(engine, sampling)
    return _stat([f() for _ in range(warmup + repeats)][warmup:], stat)


# ------------------------------------------------------------------ synthetic roofline tables

ROOFLINE_DEFAULTS = dict(
    # An H200-class accelerator (4.8 TB/s HBM, ~989 TFLOP/s dense bf16 at 60 % utilisation) serving a
    # 32B-parameter dense bf16 target (Qwen3-32B-like: 64 layers, hidden 5120, vocabulary 151,936).
    hbm_bytes_per_s=4.8e12, flops_per_s=0.6 * 989e12,
    target_bytes=65.6e9, target_flops_per_token=65.6e9, overhead_s=0.4e-3,
    # DSpark drafter: 2 target-sized layers on G+1 block tokens + the sequential head, whose G
    # steps each read and apply the shared 151,936 x 5120 LM head.
    draft_bytes=0.8e9 + 7 * 1.56e9, draft_flops_per_request=16e9 + 7 * 1.56e9, draft_overhead_s=0.2e-3,
    # MTP-1: one layer on one token + one LM-head application.
    mtp_bytes=0.5e9 + 1.56e9, mtp_flops_per_request=1e9 + 1.56e9, mtp_overhead_s=0.1e-3,
    knee_sharpness=4.0,
)

ROOFLINE_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536,
                    1792, 2048)
ROOFLINE_REQUESTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def roofline_time(n, bytes_, flops_per_item, overhead_s, hbm_bytes_per_s, flops_per_s, knee_sharpness):
    """Smooth roofline: ``overhead + (t_mem^p + (n * t_item)^p)^(1/p)``: flat (weight-read bound)
    at small n, linear (compute bound) past the knee ``n ~ t_mem / t_item``."""
    t_mem = bytes_ / hbm_bytes_per_s
    t_lin = np.asarray(n, np.float64) * flops_per_item / flops_per_s
    p = knee_sharpness
    return overhead_s + (t_mem ** p + t_lin ** p) ** (1.0 / p)


def roofline_table(buckets=ROOFLINE_BUCKETS, requests=ROOFLINE_REQUESTS, **overrides) -> dict:
    """A synthetic accelerator-shaped cost dict (see ROOFLINE_DEFAULTS for the model)."""
    c = {**ROOFLINE_DEFAULTS, **overrides}
    hw = dict(hbm_bytes_per_s=c["hbm_bytes_per_s"], flops_per_s=c["flops_per_s"], knee_sharpness=c["knee_sharpness"])
    tv = roofline_time(np.asarray(buckets), c["target_bytes"], c["target_flops_per_token"], c["overhead_s"], **hw)
    td = roofline_time(np.asarray(requests), c["draft_bytes"], c["draft_flops_per_request"], c["draft_overhead_s"], **hw)
    tm = roofline_time(np.asarray(requests), c["mtp_bytes"], c["mtp_flops_per_request"], c["mtp_overhead_s"], **hw)
    return {"format": FORMAT, "backend": "synthetic-accelerator", "device_kind": "roofline model (H200-class, 32B target)",
            "buckets": [int(b) for b in buckets], "t_verify": tv.tolist(), "t_draft": float(td[0]),
            "draft_requests": [int(r) for r in requests], "t_draft_by_requests": td.tolist(),
            "t_draft_by_kind": {"mtp1": {"draft_requests": [int(r) for r in requests],
                                         "t_draft_by_requests": tm.tolist()}},
            "provenance": ("SYNTHETIC, not measured: a smooth roofline t(B) = overhead + (t_mem^p + (B t_tok)^p)^(1/p) "
                           "modeled on published H100/H200 serving behaviour (weight-read bound and flat up to ~120 "
                           "tokens, then compute bound and linear); written by `python -m dspark_jax costs roofline`. "
                           "KV-cache reads (which grow with requests x context, not with B) are not modeled."),
            "roofline": c}


def draft_time_for(d: dict, n_requests: int, kind: str = "dspark", scale_if_missing: float = 0.5) -> float:
    """Draft time per round for a drafter ``kind`` at ``n_requests``: the file's per-kind curve
    when present (``t_draft_by_kind``), else the main draft curve (times ``scale_if_missing``
    for kinds other than dspark / dflash)."""
    if kind == "ar":
        return 0.0
    per = d.get("t_draft_by_kind", {}).get(kind)
    if per is not None:
        return float(np.interp(n_requests, per["draft_requests"], per["t_draft_by_requests"]))
    base = draft_time_at(d, n_requests)
    return base if get_kind(kind).drafts_in_parallel else scale_if_missing * base


def _build_engine(args):
    """The engine to time: random models of a config's (or the tiny) shapes, whose timing does not
    depend on the weights' values, or a checkpoint directory with a trained drafter directory, the
    models that will serve."""
    import dataclasses

    import jax.numpy as jnp

    from dspark_jax.drafter.kinds.eagle3 import EAGLE3
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    drafter_dir = args.drafter if Path(args.drafter).is_dir() else None
    e3 = args.drafter == EAGLE3.name  # testing.tiny's Eagle3 drafter fuses target layer 0
    kw = dict(max_len=args.max_len, gamma=args.gamma if e3 else None, layer_ids=(0,) if e3 else None,
              policy=verify_gamma_policy)
    if (Path(args.model) / "config.json").is_file():
        from dspark_jax.engine.generate import load_models

        lt, drafter, _ = load_models(args.model, drafter_dir, None if drafter_dir else "ar", args.dtype)
        target, cfg = lt.model, lt.model.cfg
        if drafter_dir:
            kw.update(gamma=None, layer_ids=None)  # the trained drafter's own
        elif args.drafter != "none":
            drafter = tiny_drafter(args.drafter, target, gamma=args.gamma)
    elif drafter_dir:
        raise ValueError(f"--drafter {args.drafter} is a trained drafter: give --target the checkpoint directory it "
                         "was trained for (a config or 'tiny' times random models)")
    else:
        dcfg = None
        if args.model == "tiny":
            cfg = tiny_config()
        else:
            from dspark_jax.config import from_cli

            full = from_cli([args.model])
            cfg = full.target.model
            if args.drafter in ("dspark", "dflash"):  # the preset's drafter (layers, features, Markov rank), not a toy
                dcfg = dataclasses.replace(full.drafter, kind=args.drafter, gamma=args.gamma)
        dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
        target = tiny_target(cfg, param_dtype=dtype)
        drafter = None if args.drafter == "none" else tiny_drafter(
            args.drafter, target, gamma=args.gamma, dcfg=dcfg, dtype=None if dtype == jnp.float32 else dtype)
    eng = Engine(target, drafter, EngineConfig(num_slots=args.num_slots, buckets=buckets, **kw))
    return eng, cfg, lambda r: Engine(target, drafter, EngineConfig(num_slots=r, **kw))


def _cmd_measure(args) -> int:
    import jax

    eng, cfg, make_engine = _build_engine(args)
    dev = jax.devices()[0]
    log = lambda s: print(s, flush=True)
    log(f"backend {jax.default_backend()} ({dev.device_kind}); R={eng.R} G={eng.G} buckets {list(eng.buckets)}")
    from dspark_jax.decoding.sampling import SamplingParams

    # Rounds price differently by temperature: greedy rows skip the sampled path (rejection over
    # the vocabulary at every verified position), so a table is measured at the serving setting.
    kw = dict(repeats=args.repeats, warmup=args.warmup, stat=args.stat,
              sampling=SamplingParams(args.temperature, 0, 1.0))
    res = measure_engine(eng, log=log, **kw)
    extra = {}
    if args.draft_requests and eng.G:
        rs = sorted({int(r) for r in args.draft_requests.split(",")} | {eng.R})
        tds = [res["t_draft"] if r == eng.R else draft_time(make_engine(r), **kw) for r in rs]
        for r, t in zip(rs, tds):
            log(f"draft per round at {r:4d} requests: {1e3 * t:.3f} ms")
        extra = {"draft_requests": rs, "t_draft_by_requests": tds}
    path = save_cost_file(
        args.out, res["buckets"], res["t_verify"], res["t_draft"], backend=jax.default_backend(),
        device_kind=dev.device_kind,
        provenance=(f"measured by `python -m dspark_jax costs measure` on {jax.default_backend()} ({dev.device_kind}), "
                    f"model {args.model}, drafter {args.drafter}, {args.dtype}, temperature {args.temperature:g}, "
                    f"{'the checkpoint' if (Path(args.model) / 'config.json').is_file() else 'random'} weights; t_verify(b) = compiled round "
                    "landing in bucket b minus the engine's draft function on the same state"),
        measured_on=MEASURED_ON, t_round=res["t_round"], t_draft_paired=res["t_draft_paired"], plan=res["plan"],
        clipped=res["clipped"],
        engine={"num_slots": eng.R, "gamma": eng.G, "mode": eng.mode, "max_len": eng.S, "model": args.model,
                "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
                "dtype": args.dtype},
        measure={"repeats": args.repeats, "warmup": args.warmup, "stat": args.stat, "temperature": args.temperature,
                 "when": time.strftime("%Y-%m-%d %H:%M:%S")}, **extra)
    log(f"wrote {path}")
    return 0


def _cmd_roofline(args) -> int:
    path = _write_checked(args.out, roofline_table())
    print(f"wrote {path}")
    return 0


def _cmd_show(args) -> int:
    d = load_cost_file(args.path)
    print(f"{args.path}: backend {d['backend']} ({d['device_kind']}); t_draft {1e3 * d['t_draft']:.3f} ms")
    print(f"provenance: {d.get('provenance')}")
    print(f"measured on: {d.get('measured_on', 'standalone verification forward (older table)')}")
    for b, t in zip(d["buckets"], d["t_verify"]):
        print(f"  B={b:6d}  T_verify={1e3 * t:9.3f} ms  SPS={1 / t:9.1f}  tokens/s at full bucket={b / t:12.0f}")
    return 0


def plot_tables(paths, out, *, per_slot: bool = False):
    """T_verify against B for each table (one line each, named by its file): dashed lines for
    files named before*, in the colour of the matching after*, so a before / after set reads at a
    glance. `per_slot`: B / R on the x
    axis (tables measured at several R on one scale) and times relative to B = R."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    colors: dict[str, str] = {}  # before_X and after_X share a colour
    for path in paths:
        d = load_cost_file(path)
        b = np.asarray(d["buckets"], float)
        t = 1e3 * np.asarray(d["t_verify"], float)
        name = Path(path).stem
        r = int((d.get("engine") or {}).get("num_slots", b[0])) if per_slot else 1
        x, y = (b / r, t / t[0]) if per_slot else (b, t)
        before = name.startswith("before")
        key = name.removeprefix("before").removeprefix("after").strip("_-")
        color = colors.setdefault(key, f"C{len(colors) % 10}")
        ax.plot(x, y, "o--" if before else "o-", color=color, alpha=0.6 if before else 1.0, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens verified per slot (B / R)" if per_slot else "tokens verified B")
    ax.set_ylabel("T_verify(B) / T_verify(R)" if per_slot else "T_verify (ms)")
    ax.set_title("what B costs: verification time per round")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _cmd_plot(args) -> int:
    print(f"wrote {plot_tables(args.paths, args.out, per_slot=args.per_slot)}")
    return 0


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax costs", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the engine's compiled round per bucket and its draft step")
    m.add_argument("--target", "--model", dest="model", default="tiny",
                   help="'tiny', a config name/path (e.g. micro, bench_cpu: random weights), or a checkpoint directory")
    m.add_argument("--drafter", default="dspark", metavar="{" + ",".join([*KIND_NAMES, "none"]) + "} or DIR",
                   help="drafter kind (random; with a config --target, DSpark / DFlash take its drafter section's "
                        "shape) or a trained drafter directory (with its checkpoint --target)")
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="target weights and compute dtype (the drafter computes in it), as the engine would run")
    m.add_argument("--slots", "--num-slots", dest="num_slots", type=int, default=8)
    m.add_argument("--gamma", type=int, default=7)
    m.add_argument("--max-len", type=int, default=256)
    m.add_argument("--temperature", type=float, default=1.0,
                   help="sampling temperature of the timed rounds (0 = greedy, cheaper: no rejection over the "
                        "vocabulary; default 1); measure the table at the temperature it will serve")
    m.add_argument("--buckets", default=None, help="comma-separated bucket sizes (default: the engine's)")
    m.add_argument("--repeats", type=int, default=7)
    m.add_argument("--warmup", type=int, default=2)
    m.add_argument("--stat", default="median", choices=["median", "min"], help="min resists a shared, noisy host")
    m.add_argument("--draft-requests", default=None, help="also time drafting at these slot counts, e.g. 1,16,64")
    m.add_argument("--out", required=True, help="output JSON (e.g. configs/costs/<backend>_<model>.json)")
    r = sub.add_parser("roofline", help="write the synthetic accelerator-shaped table (documented roofline model)")
    r.add_argument("--out", default="configs/costs/accelerator_synthetic.json")
    s = sub.add_parser("show", help="print a cost table")
    s.add_argument("path")
    pl = sub.add_parser("plot", help="plot T_verify against B for cost tables (files named before* dashed)")
    pl.add_argument("paths", nargs="+")
    pl.add_argument("--out", required=True, help="PNG to write")
    pl.add_argument("--per-slot", action="store_true", help="x = B / R, y relative to B = R (tables of several R)")
    args = ap.parse_args(argv)
    if args.cmd == "measure" and args.drafter not in (*KIND_NAMES, "none") and not Path(args.drafter).is_dir():
        ap.error(f"--drafter {args.drafter!r}: give a kind ({', '.join(KIND_NAMES)}, none) or a trained drafter directory")
    return {"measure": _cmd_measure, "roofline": _cmd_roofline, "show": _cmd_show, "plot": _cmd_plot}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
