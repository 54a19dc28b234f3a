"""Verification cost tables (docs/method.md §3.1): measure on the engine's compiled round, save, load, check.

    python -m dspark_jax costs measure --target tiny --slots 8 --gamma 3 --out configs/costs/cpu_tiny.json
    python -m dspark_jax costs roofline --out configs/costs/accelerator_synthetic.json   # synthetic, documented
    python -m dspark_jax costs show configs/costs/accelerator_synthetic.json

A cost file is JSON::

    {"format": "dspark_cost_table/1", "backend": "cpu", "device_kind": "cpu",
     "buckets": [8, 16, 32], "t_verify": [s, s, s],      # seconds per target verification step
     "t_draft": s,                                       # seconds of drafting per round (at num_slots)
     "draft_requests": [..], "t_draft_by_requests": [..],  # optional: draft time vs concurrency
     "t_draft_by_kind": {"mtp1": {"draft_requests": [..], "t_draft_by_requests": [..]}},  # optional
     "t_skip": s, "t_target_step": s,                    # optional: a round without a draft / the
                                                         # target-only step, at engine.num_slots
     "measured_on": "compiled_round",                    # measured tables: t_verify from the engine's round
     "t_round": [..], "plan": [..],                      # measured tables: whole-round times, (k, g) per bucket
     "provenance": "...", "engine": {...}, "measure": {...}}

The scheduler consumes it as a :class:`dspark_jax.scheduler.prefix.CostTable`; what a round
without a draft costs (:func:`skip_extra`) comes from ``t_skip``, else ``t_target_step``.
Loading checks that times are positive and finite and, when asked, that the table was measured
for the expected backend and bucket set (a table from other hardware is fine for simulation,
not for scheduling a live engine).

Measurement (:func:`measure_engine`) times the engine's own compiled round (`Engine.step`)
once per bucket, each round's length pinned (`Control.pin`), so k active slots
verifying g drafts each pack k * (1 + g) tokens and the round runs that bucket's branch of
its `lax.switch` (checked on `RoundOut.bucket`). The draft part is the engine's draft
function timed on the same state, alternating with the rounds; ``t_verify(b) = t_round(b) -
t_draft`` (the draft of the same time window). The core,
:func:`measure_table`, only needs ``round_fn(bucket) -> seconds`` and ``draft_fn() -> seconds``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np

from dspark_jax.drafter.registry import get_kind
from dspark_jax.io.files import read_json
from dspark_jax.scheduler.prefix import CostTable, make_table

__all__ = ["CostTableError", "MeasureError", "FORMAT", "MEASURED_ON", "PREDICTED_ON", "table_origin", "describe_table",
           "expect_table_for", "with_overhead", "SKIPPED_ROUND", "skipped_round_price", "skip_extra", "load_cost_file",
           "load_cost_table",
           "save_cost_file", "measure_table", "bucket_plan", "time_call", "draft_time_at", "draft_time_for",
           "roofline_table", "roofline_time", "plot_tables", "write_checked"]

FORMAT = "dspark_cost_table/1"
log = logging.getLogger(__name__)


class CostTableError(ValueError):
    pass


PREDICTED_ON = "xla_tpu_cost_model"  # engine/predict.py marks its tables so


def table_origin(d: dict) -> str:
    """"predicted" (by the TPU compiler's cost model), "synthetic" (a roofline model) or "measured"."""
    if d.get("predicted_on") == PREDICTED_ON:
        return "predicted"
    if str(d.get("backend", "")).startswith("synthetic"):
        return "synthetic"
    return "measured"


def describe_table(d: dict, where: str) -> str:
    """One line naming a table's origin, for every place that shows or uses one."""
    origin = table_origin(d)
    what = {"predicted": f"PREDICTED (not measured) for {d.get('device_kind')} by the XLA:TPU cost model",
            "synthetic": "SYNTHETIC (a roofline model, not measured)",
            "measured": f"measured on {d.get('backend')} ({d.get('device_kind')})"}[origin]
    return f"cost table {where}: {what}"


def _check(d: dict, where: str, expect_backend=None, expect_buckets=None) -> None:
    if d.get("format") != FORMAT:
        raise CostTableError(f"{where}: not a cost table (format {d.get('format')!r}, expected {FORMAT!r}); "
                             "write it with `python -m dspark_jax costs measure`")
    if not str(d.get("provenance") or "").strip():
        raise CostTableError(f"{where}: the table says nowhere where its times come from (no 'provenance'): a "
                             "table is measured (`costs measure`), predicted (`costs predict`) or synthetic "
                             "(`costs roofline`); write it again with one of them")
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
    if expect_backend is not None and table_origin(d) != "measured":
        raise CostTableError(f"{where}: {describe_table(d, where).split(': ', 1)[1]}: a live engine schedules with "
                             "times measured on its own hardware; measure a table there with "
                             "`python -m dspark_jax costs measure` (predicted and synthetic tables are for "
                             "`python -m dspark_jax simulate`)")
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


SKIPPED_ROUND = "plain_round"  # the program a predicted `skip@R` prices now (engine/round.py)


def skipped_round_price(d: dict) -> float | None:
    """A cost dict's price of a round that skips drafting at its slot count: ``t_skip`` where it
    prices the engine's round without a draft (a predicted table's `skip@R` compiled from
    `round.plain_round`, as its program record says), else no less than the target-only step
    ``t_target_step`` (which that round runs; tables predicted before it priced a skipped round
    that drafted nothing but still ran the drafting round's rejection and drafter update over the
    whole block); None where it prices neither."""
    skip = (d.get("programs") or {}).get(f"skip@{(d.get('engine') or {}).get('num_slots')}")
    if "t_skip" in d and (skip is None or skip.get("program") == SKIPPED_ROUND):
        return float(d["t_skip"])
    return float(d["t_target_step"]) if "t_target_step" in d else None


def skip_extra(d: dict) -> float:
    """Seconds a round without a draft costs beyond ``t_verify`` of the tokens it verifies (the
    CostTable's `skip_extra`; `prefix.plain_time`), from a cost dict: `skipped_round_price` at
    the table's slot count R (``engine.num_slots``) minus ``t_verify(R)`` (interpolated), no
    less than 0 and no more than ``t_draft`` (a round that skips drafting does less than one that
    drafts in the same bucket; more is noise, and would make a draft that cannot pay look cheaper
    than not drafting); 0 for a table that prices neither (or does not say R): then ``t_verify`` is
    all it knows of plain decoding. ``t_verify(b)`` is a round minus the draft timed alone, which
    costs more than it adds to a round, so ``t_verify(R)`` alone under-prices plain decoding."""
    r = (d.get("engine") or {}).get("num_slots")
    t = skipped_round_price(d)
    if r is None or t is None:
        return 0.0
    return float(np.clip(t - float(np.interp(r, d["buckets"], d["t_verify"])), 0.0, float(d["t_draft"])))


def load_cost_table(path, expect_backend=None, expect_buckets=None, as_numpy=False) -> CostTable:
    """Load a cost file as the scheduler's CostTable (see module doc for the checks); its origin
    is logged."""
    d = load_cost_file(path, expect_backend, expect_buckets)
    log.info(describe_table(d, str(path)))
    return make_table(d["buckets"], t_verify=d["t_verify"], t_draft=d["t_draft"], as_numpy=as_numpy,
                      skip_extra=skip_extra(d))


def expect_table_for(d: dict, where: str, **expected) -> None:
    """Refuse a table made for another setting: each of `expected` (e.g. topology="v6e-8",
    target="configs/qwen3_8b_dspark.yaml", drafter="dspark") that the table records and that
    differs is named, with both values."""
    bad = [f"{k} {d.get(k)!r} (wanted {v!r})" for k, v in expected.items()
           if v is not None and d.get(k) is not None and str(d.get(k)) != str(v)]
    if bad:
        raise CostTableError(f"{where}: made for another setting: {', '.join(bad)}; predict or measure a table for "
                             "this one")


def with_overhead(d: dict, seconds: float, source: str, per_draft_token: float = 0.0) -> dict:
    """The table with `seconds` added to every round (host overhead, launch latency: what a
    cost model does not see) and `per_draft_token` x the tokens a drafting round drafts (the
    table's R x each kind's gamma) added to its draft time, recorded with their source."""
    if not (seconds >= 0 and per_draft_token >= 0):
        raise CostTableError(f"overhead {seconds} s per round, {per_draft_token} s per drafted token: must be >= 0")
    out = {**d, "t_verify": [t + seconds for t in d["t_verify"]], "overhead_s": seconds, "overhead_source": source}
    for k in ("t_target_step", "t_skip"):  # whole rounds too
        if k in d:
            out[k] = d[k] + seconds
    if per_draft_token:
        r, g = (d.get("engine") or {}).get("num_slots"), (d.get("engine") or {}).get("gamma")
        if not r or g is None:
            raise CostTableError("a per-drafted-token overhead needs the table's engine.num_slots and engine.gamma")
        out["t_draft"] = d["t_draft"] + per_draft_token * r * g
        out["t_draft_by_kind"] = {
            k: {**v, "t_draft_by_requests": [t + per_draft_token * n * v.get("gamma", g)
                                             for n, t in zip(v["draft_requests"], v["t_draft_by_requests"])]}
            for k, v in d.get("t_draft_by_kind", {}).items()}
        out["overhead_per_draft_token_s"] = per_draft_token
    return out


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
    return write_checked(path, d)


def write_checked(path, d: dict) -> Path:
    """Check a cost dict as loading will, then write it as JSON (parents created), whole or not
    at all: written beside and renamed, so a reader never sees half a table."""
    _check(d, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    part.write_text(json.dumps(d, indent=1))
    os.replace(part, path)
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
    return time_stat(ts, stat)


def time_stat(ts, stat: str) -> float:
    return float(np.median(ts) if stat == "median" else np.min(ts))


def measure_table(round_fn: Callable[[int], float], buckets, draft_fn: Callable[[], float] | None = None, *,
                  repeats: int = 5, warmup: int = 1, stat: str = "median", log=None, floor: float = FLOOR_S,
                  skip_fn: Callable[[], float] | None = None, warm_programs: bool = False,
                  draft_from_skip: int | None = None) -> dict:
    """-> {"buckets", "t_verify", "t_draft", "t_round", "t_draft_paired", "clipped", "repriced", "draft_from"
    ("timer", "skip" or "none"), "warm_seconds"} (and "t_skip" with ``skip_fn``) from one-sample
    timers ``round_fn(bucket) -> seconds`` (one whole round landing in that bucket),
    ``draft_fn() -> seconds`` (the round's draft part) and
    ``skip_fn() -> seconds`` (the round that skips drafting).

    The buckets are timed in sweeps: each sweep calls every bucket once, a draft then a round, and
    then the skipped round, so a load that comes and goes on a shared host hits them all alike
    (``warmup`` untimed sweeps first, then ``repeats`` timed ones). ``t_verify(b) = stat(rounds at b)
    - stat(the drafts paired with them)`` and ``t_draft`` is ``stat`` over all draft samples.
    Everything in the round besides drafting (verification, sampling, rejection, rollback, drafter
    update) is thus charged to verification, and ``t_draft + t_verify(b)`` is the measured round. A
    non-positive difference (noise when drafting dominates the round) is clipped to ``floor`` with
    a warning (``clipped``).

    ``warm_programs``: before the sweeps, call each program once untimed (a round, the draft, the
    skipped round: every bucket is a branch of one round program, so its first call compiles them
    all) instead of whole ``warmup`` sweeps (their seconds: ``warm_seconds``). ``draft_from_skip``:
    with ``skip_fn`` and no ``draft_fn``, the bucket whose round is the skipped round plus the draft (every slot active,
    no draft verified); ``t_draft = stat(rounds there) - t_skip``, what skipping the draft saves, so
    no draft program is compiled and timed apart, and ``t_verify`` of that bucket is ``t_skip``.

    A larger bucket priced below a smaller one stands only when its round was the faster of the two
    in every sweep; otherwise the smaller bucket takes its price (``repriced``). The same program
    holding fewer tokens does not cost more, so such an inversion is noise unless each sweep repeats
    it (on a TPU a larger bucket can be cheaper: docs/performance.md); a round picks the cheapest
    bucket its table prices (`round._bucket`), and a noisy price would send it to a larger one for
    good, where no round is left to correct the smaller one's (engine/live_costs.py).
    """
    bs = sorted(int(x) for x in buckets)
    if draft_from_skip is not None and (skip_fn is None or draft_fn is not None or draft_from_skip not in bs):
        raise MeasureError(f"draft_from_skip={draft_from_skip} needs skip_fn, no draft_fn and a bucket among {bs}")
    r = {b: [] for b in bs}
    d = {b: [] for b in bs}
    skips = []
    t0 = time.perf_counter()
    if warm_programs:
        for fn in (lambda: round_fn(bs[0]), draft_fn, skip_fn):
            if fn is not None:
                fn()
    warm_seconds = time.perf_counter() - t0
    for sweep in range(warmup + repeats):
        timed = sweep >= warmup
        for b in bs:
            if draft_fn is not None:
                t = float(draft_fn())
                d[b] += [t] if timed else []
            t = float(round_fn(b))
            r[b] += [t] if timed else []
        if skip_fn is not None:
            t = float(skip_fn())
            skips += [t] if timed else []
    tr = [time_stat(r[b], stat) for b in bs]
    tdp = [time_stat(d[b], stat) if d[b] else 0.0 for b in bs]
    if draft_from_skip is not None:
        saved = tr[bs.index(draft_from_skip)] - time_stat(skips, stat)
        if not saved > 0:
            msg = (f"the round at bucket {draft_from_skip} ({1e3 * tr[bs.index(draft_from_skip)]:.3f} ms) is no slower "
                   f"than the round that skips drafting ({1e3 * time_stat(skips, stat):.3f} ms), so the draft is "
                   f"priced at {floor:g} s; timing noise dominates: re-measure on a quieter host or with more repeats")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            if log:
                log("WARNING: " + msg)
            saved = floor
        tdp = [saved] * len(bs)
    tv, clipped = [], []
    for b, t_round, t_draft in zip(bs, tr, tdp, strict=True):
        t = t_round - t_draft
        if not t > 0:
            clipped.append(b)
            msg = (f"bucket {b}: round {1e3 * t_round:.3f} ms <= draft {1e3 * t_draft:.3f} ms, so t_verify is clipped "
                   f"to {floor:g} s; timing noise dominates: re-measure on a quieter host or with more --repeats")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            if log:
                log("WARNING: " + msg)
            t = floor
        tv.append(t)
    tv, repriced = _noise_inversions_repriced(bs, tv, r)
    if log:
        for b, t_round, t_draft, t in zip(bs, tr, tdp, tv, strict=True):
            log(f"bucket {b:6d}: round {1e3 * t_round:9.3f} ms  draft {1e3 * t_draft:9.3f} ms  verify {1e3 * t:9.3f} ms"
                + ("  (repriced: a larger bucket measured cheaper, not in every sweep)" if b in repriced else ""))
    d_all = [x for b in bs for x in d[b]]
    td = tdp[0] if draft_from_skip is not None else time_stat(d_all, stat) if d_all else 0.0
    if log:
        log(f"draft per round: {1e3 * td:.3f} ms")
    out = {"buckets": bs, "t_verify": tv, "t_draft": td, "t_round": tr, "t_draft_paired": tdp, "clipped": clipped,
           "repriced": repriced, "draft_from": "timer" if draft_fn is not None else
           "skip" if draft_from_skip is not None else "none", "warm_seconds": warm_seconds}
    if skip_fn is not None:
        out["t_skip"] = time_stat(skips, stat)
        if log:
            log(f"round that skips drafting: {1e3 * out['t_skip']:.3f} ms")
    return out


def _noise_inversions_repriced(bs, tv, rounds) -> tuple[list[float], list[int]]:
    """(t_verify, repriced buckets): each bucket priced above a larger one whose round was not the
    faster in every sweep takes the cheapest such larger bucket's price (`measure_table`)."""
    out, repriced = list(tv), []
    for i, b in enumerate(bs):
        noisy = [tv[j] for j in range(i + 1, len(bs)) if tv[j] < tv[i]
                 and not all(x < y for x, y in zip(rounds[bs[j]], rounds[b], strict=True))]
        if noisy:
            out[i] = min(noisy)
            repriced.append(b)
    return out, repriced


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
            "engine reaches (e.g. multiples of num_slots up to num_slots * (gamma + 1)), or raise --slots")
    return plan












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
    td = roofline_time(np.asarray(requests), c["draft_bytes"], c["draft_flops_per_request"],
                       c["draft_overhead_s"], **hw)
    tm = roofline_time(np.asarray(requests), c["mtp_bytes"], c["mtp_flops_per_request"], c["mtp_overhead_s"], **hw)
    return {"format": FORMAT, "backend": "synthetic-accelerator",
            "device_kind": "roofline model (H200-class, 32B target)",
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


