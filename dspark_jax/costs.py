"""Verification cost tables (spec 3.1): measure on the engine's verification function, save, load, check.

    python -m dspark_jax.costs measure --model tiny --num-slots 8 --gamma 3 --out configs/costs/cpu_tiny.json
    python -m dspark_jax.costs roofline --out configs/costs/accelerator_synthetic.json   # synthetic, documented
    python -m dspark_jax.costs show configs/costs/accelerator_synthetic.json

A cost file is JSON::

    {"format": "dspark_cost_table/1", "backend": "cpu", "device_kind": "cpu",
     "buckets": [8, 16, 32], "t_verify": [s, s, s],      # seconds per target verification step
     "t_draft": s,                                       # seconds of drafting per round (at num_slots)
     "draft_requests": [..], "t_draft_by_requests": [..],  # optional: draft time vs concurrency
     "t_draft_by_kind": {"mtp1": {"draft_requests": [..], "t_draft_by_requests": [..]}},  # optional
     "provenance": "...", "engine": {...}, "measure": {...}}

The scheduler consumes it as a :class:`dspark_jax.scheduler.CostTable`. Loading checks that
times are positive and finite and, when asked, that the table was measured for the
expected backend and bucket set (a table from other hardware is fine for simulation, not
for scheduling a live engine).

Measurement works against a small interface so any engine plugs in: ``verify_fn(bucket) ->
seconds`` (one verification step at that bucket, already compiled) and ``draft_fn() ->
seconds``; :func:`engine_timers` builds both from a `dspark_jax.engine.Engine`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

from dspark_jax.scheduler import CostTable, make_table

__all__ = ["CostTableError", "FORMAT", "load_cost_file", "load_cost_table", "save_cost_file", "measure_table",
           "time_call", "engine_timers", "draft_time_at", "draft_time_for", "roofline_table",
           "roofline_time", "main"]

FORMAT = "dspark_cost_table/1"


class CostTableError(ValueError):
    pass


def _check(d: dict, where: str, expect_backend=None, expect_buckets=None) -> None:
    if d.get("format") != FORMAT:
        raise CostTableError(f"{where}: not a cost table (format {d.get('format')!r}, expected {FORMAT!r}); "
                             "write it with `python -m dspark_jax.costs measure`")
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
                             f"on {expect_backend!r}: measure a table here with `python -m dspark_jax.costs measure`")
    if expect_buckets is not None and [int(x) for x in b] != sorted(int(x) for x in expect_buckets):
        raise CostTableError(f"{where}: measured for buckets {[int(x) for x in b]}, the engine compiles "
                             f"{sorted(int(x) for x in expect_buckets)}: re-measure with these buckets")


def load_cost_file(path, expect_backend=None, expect_buckets=None) -> dict:
    """The checked JSON dict of a cost file."""
    path = Path(path)
    if not path.exists():
        raise CostTableError(f"cost table {path} does not exist")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CostTableError(f"{path}: not valid JSON ({e})") from None
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
    _check(d, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1))
    return path


# ------------------------------------------------------------------ measuring


def time_call(fn: Callable[[], object], repeats: int = 5, warmup: int = 1, stat: str = "median") -> float:
    """Seconds per call of ``fn`` (which must block until its result is ready)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts) if stat == "median" else np.min(ts))


def measure_table(verify_fn: Callable[[int], float], buckets, draft_fn: Callable[[], float] | None = None,
                  log=None) -> dict:
    """-> {"buckets", "t_verify", "t_draft"} from ``verify_fn(bucket) -> seconds`` and ``draft_fn() -> seconds``."""
    tv = []
    for b in sorted(int(x) for x in buckets):
        tv.append(float(verify_fn(b)))
        if log:
            log(f"bucket {b:6d}: {1e3 * tv[-1]:9.3f} ms")
    td = float(draft_fn()) if draft_fn is not None else 0.0
    if log:
        log(f"draft per round: {1e3 * td:.3f} ms")
    return {"buckets": sorted(int(x) for x in buckets), "t_verify": tv, "t_draft": td}


def engine_timers(engine, repeats: int = 5, warmup: int = 1, stat: str = "median"):
    """``(verify_fn, draft_fn)`` for an Engine: its verification forward (`verify_packed`, the
    function each bucket branch of the compiled round runs) jitted per bucket with a batch of
    exactly ``bucket`` valid tokens (or all R * (G + 1) when the bucket is larger), and its
    draft step (`drafts.draft`) on the engine's R slots. Positions sit mid-cache."""
    import jax
    import jax.numpy as jnp

    from dspark_jax.engine.drafts import draft
    from dspark_jax.engine.round import row_round_keys
    from dspark_jax.engine.verify import verify_packed
    from dspark_jax.sampling import SamplingParams

    spec, R, G, S = engine.spec, engine.R, engine.G, engine.S
    st = engine.init_state()
    pos = jnp.full((R,), max(S // 2 - G - 1, 0), jnp.int32)
    toks = jnp.ones((R, G + 1), jnp.int32)

    compiled = {}

    def verify_fn(bucket: int) -> float:
        if bucket not in compiled:
            f = jax.jit(lambda tp, cache, valid: verify_packed(tp, spec.tcfg, cache, toks, pos, valid, bucket=bucket,
                                                               feature_layers=spec.feature_layers).logits)
            compiled[bucket] = f
        n = min(bucket, R * (G + 1))
        flat = jnp.arange(R * (G + 1)) < n  # row-major fill: whole rows first
        valid = flat.reshape(R, G + 1)
        f = compiled[bucket]
        return time_call(lambda: f(engine.tp, st.cache, valid).block_until_ready(), repeats, warmup, stat)

    def draft_fn() -> float:
        if not G:
            return 0.0
        samp = SamplingParams(*(jnp.broadcast_to(jnp.asarray(v, dt), (R,)) for v, dt in
                                zip((1.0, 0, 1.0), (jnp.float32, jnp.int32, jnp.float32))))
        kd, _ = row_round_keys(st.keys, st.rounds)
        f = jax.jit(lambda dp, dcache, last: draft(spec, dp, dcache, last, st.anchor, pos, kd, samp)[:3])
        return time_call(lambda: jax.block_until_ready(f(engine.dp, st.dcache, st.last)), repeats, warmup, stat)

    return verify_fn, draft_fn


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
                           "tokens, then compute bound and linear); written by `python -m dspark_jax.costs roofline`. "
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
    return base if kind in ("dspark", "dflash") else scale_if_missing * base


def _build_engine(args):
    """A random-init engine of the requested size (timing does not depend on the weights' values)."""
    from dspark_jax.engine import Engine
    from dspark_jax.engine.testing import tiny_config, tiny_drafter, tiny_target

    if args.model == "tiny":
        cfg = tiny_config()
    else:
        from dspark_jax.config import from_cli

        cfg = from_cli([args.model]).target.model
    target = tiny_target(cfg)
    drafter = None if args.drafter == "none" else tiny_drafter(args.drafter, target, gamma=args.gamma)
    buckets = [int(b) for b in args.buckets.split(",")] if args.buckets else None
    kw = dict(max_len=args.max_len, gamma=args.gamma if args.drafter == "eagle3" else None)
    eng = Engine(target, drafter, num_slots=args.num_slots, buckets=buckets, **kw)
    return eng, cfg, lambda r: Engine(target, drafter, num_slots=r, **kw)


def _cmd_measure(args) -> int:
    import jax

    eng, cfg, make_engine = _build_engine(args)
    dev = jax.devices()[0]
    log = lambda s: print(s, flush=True)
    log(f"backend {jax.default_backend()} ({dev.device_kind}); R={eng.R} G={eng.G} buckets {list(eng.buckets)}")
    timers = lambda e: engine_timers(e, repeats=args.repeats, warmup=args.warmup, stat=args.stat)
    verify_fn, draft_fn = timers(eng)
    res = measure_table(verify_fn, eng.buckets, draft_fn, log=log)
    extra = {}
    if args.draft_requests and eng.G:
        rs = sorted({int(r) for r in args.draft_requests.split(",")} | {eng.R})
        tds = [res["t_draft"] if r == eng.R else timers(make_engine(r))[1]() for r in rs]
        for r, t in zip(rs, tds):
            log(f"draft per round at {r:4d} requests: {1e3 * t:.3f} ms")
        extra = {"draft_requests": rs, "t_draft_by_requests": tds}
    path = save_cost_file(
        args.out, res["buckets"], res["t_verify"], res["t_draft"], backend=jax.default_backend(),
        device_kind=dev.device_kind,
        provenance=(f"measured by `python -m dspark_jax.costs measure` on {jax.default_backend()} ({dev.device_kind}), "
                    f"model {args.model}, drafter {args.drafter}, random weights"),
        engine={"num_slots": eng.R, "gamma": eng.G, "mode": eng.mode, "max_len": eng.S, "model": args.model,
                "hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size},
        measure={"repeats": args.repeats, "warmup": args.warmup, "stat": args.stat,
                 "when": time.strftime("%Y-%m-%d %H:%M:%S")}, **extra)
    log(f"wrote {path}")
    return 0


def _cmd_roofline(args) -> int:
    path = Path(args.out)
    d = roofline_table()
    _check(d, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(d, indent=1))
    print(f"wrote {path}")
    return 0


def _cmd_show(args) -> int:
    d = load_cost_file(args.path)
    print(f"{args.path}: backend {d['backend']} ({d['device_kind']}); t_draft {1e3 * d['t_draft']:.3f} ms")
    print(f"provenance: {d.get('provenance')}")
    for b, t in zip(d["buckets"], d["t_verify"]):
        print(f"  B={b:6d}  T_verify={1e3 * t:9.3f} ms  SPS={1 / t:9.1f}  tokens/s at full bucket={b / t:12.0f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax.costs", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="time the engine's verification per bucket and its draft step")
    m.add_argument("--model", default="tiny", help="'tiny' or a config name/path (e.g. micro, bench_cpu)")
    m.add_argument("--drafter", default="dspark", choices=["dspark", "dflash", "eagle3", "mtp1", "none"])
    m.add_argument("--num-slots", type=int, default=8)
    m.add_argument("--gamma", type=int, default=7)
    m.add_argument("--max-len", type=int, default=256)
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
    args = ap.parse_args(argv)
    return {"measure": _cmd_measure, "roofline": _cmd_roofline, "show": _cmd_show}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
