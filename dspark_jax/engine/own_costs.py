"""The engine's own cost table: its compiled programs timed on the machine that runs them, kept in
the user cache under a key of everything that decides those times.

A scheduled engine (docs/scheduler.md) prices verification with measured times: the round at every
verification bucket, the draft, the round that skips drafting. `costs measure` takes them as a
separate, longer step; an engine without a table takes them itself, on the programs it compiled
anyway (`timing.measure_engine`: each timed round's length pinned, `Control.pin`), in `repeats`
sweeps of the buckets after one untimed call of each program, their medians (`costs.measure_table`);
under a skip rule the draft is priced at what skipping it saves (the round with every slot active
and no draft verified minus the skipped round), so no program is compiled for the table alone.
The table is written to
``$DSPARK_JAX_CACHE/cost_tables/<key>.json``; the next engine with the same key reads it back
instead of timing again, and one with any other key never reads it
(``$DSPARK_JAX_COST_TABLES`` moves the directory). The key (`table_key`) hashes
the backend and device kind, the device count and mesh, every target and drafter array's shape
and dtype, the slots, cache length, buckets (priced and compiled), paged KV and its reader,
prompt chunks, the policy and skip rule (both change the round program), the sampling the rounds
were timed at, this package's version and a digest of its source (the programs timed are the
source's: a table timed on other programs is never read back).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import jax

import dspark_jax
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.timing import measure_engine
from dspark_jax.io.cache import cache_root
from dspark_jax.io.program_store import source_digest
from dspark_jax.parallel.platform import device_kind, platform
from dspark_jax.scheduler.costs import (
    MEASURED_ON,
    CostTableError,
    load_cost_file,
    save_cost_file,
    skip_extra,
)
from dspark_jax.scheduler.prefix import make_table

__all__ = ["OwnTable", "TABLES_ENV", "table_key", "table_path", "tables_dir", "own_table", "planned", "DEFAULT_REPEATS"]

log = logging.getLogger(__name__)

DEFAULT_REPEATS = 3  # timed sweeps of the buckets (after one untimed call of each program): medians of three


@dataclass(frozen=True)
class OwnTable:
    """A cost table and where it came from: "measured" (now, `repeats` sweeps) or "read back"
    (from `path`, measured by an earlier engine of the same key)."""

    table: object  # scheduler.CostTable
    source: str
    path: Path
    repeats: int
    seconds: float  # spent measuring (0 when read back)
    first_calls: float = 0.0  # of which the first call of each program (its compile, which serving needs anyway)

    @property
    def timing_seconds(self) -> float:
        """The seconds spent timing, beyond the first calls (what the table adds to a start)."""
        return self.seconds - self.first_calls

    def describe(self) -> str:
        what = (f"measured now ({self.repeats} timed sweeps of the buckets, median; {self.timing_seconds:.1f} s "
                f"timing after {self.first_calls:.1f} s in the first call of each program, which compiles it)"
                if self.source == "measured" else "read back")
        return f"own cost table {what}: {self.path}"


def _arrays(tree) -> list:
    return [[jax.tree_util.keystr(p), list(a.shape), str(a.dtype)] for p, a in jax.tree.leaves_with_path(tree)]


def table_key(engine, sampling: SamplingParams) -> dict:
    """Everything that decides the times of `engine`'s programs (see the module doc)."""
    cfg, mesh = engine.config, engine.mesh
    return {"package": dspark_jax.__version__, "source": source_digest()[:16], "backend": platform(mesh),
            "device_kind": device_kind(mesh),
            "devices": len(jax.devices()) if mesh is None else int(mesh.devices.size),
            "mesh": None if mesh is None else dict(mesh.shape), "mode": engine.mode,
            "target": _arrays(engine.tp), "drafter": _arrays(engine.dp), "slots": engine.R, "max_len": engine.S,
            "gamma": engine.G, "priced_buckets": list(engine.priced_buckets), "buckets": list(engine.buckets),
            "kv_pages": cfg.kv_pages, "cache_reads": engine.cache_reads, "prefill_chunk": engine.prefill_chunk,
            "policy": engine.policy_name, "theta": cfg.theta, "cost": cfg.cost, "skip": engine.spec.skip_drafting,
            "sampling": [float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)]}


TABLES_ENV = "DSPARK_JAX_COST_TABLES"  # where the tables go (default: the user cache's cost_tables/)


def tables_dir() -> Path:
    env = os.environ.get(TABLES_ENV)
    return Path(env).expanduser() if env else cache_root() / "cost_tables"


def table_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return tables_dir() / f"{digest}.json"


def planned(engine, sampling: SamplingParams | None = None) -> str:
    """What `own_table` will do for `engine`, in words, before it runs (for a startup line)."""
    path = table_path(table_key(engine, sampling or SamplingParams()))
    if path.exists():
        return f"own, read back from {path}"
    return (f"own, measured at start-up ({engine.config.own_costs_repeats} timed sweeps of the buckets, median), "
            f"written to {path}")


def _as_table(d: dict):
    return make_table(d["buckets"], t_verify=d["t_verify"], t_draft=d["t_draft"], skip_extra=skip_extra(d))


def _timing_prompt(engine) -> int:
    """Prompt tokens of each timed slot: about half the cache (`timing.prefilled_state`), or with
    paged KV what leaves every slot room for a few rounds in the page pool."""
    half = max(min(engine.S // 2 - engine.G, engine.S - engine.G - 2, engine.prefill_buckets[-1]), 1)
    if engine.pages is None:
        return half
    per_slot = engine.pages.num_pages * engine.pages.page_size // engine.R
    return max(min(half, per_slot - 2 * engine.pages.page_size - 4 * (engine.G + 1)), 1)


def _timing_state(engine) -> dict:
    """How the timed state is made (`timing.prefilled_state`): with dense caches a one-token prompt
    whose rows are then moved to the timing length (attention reads that many keys whatever they
    hold: the rounds cost what they would, without forwarding a context into every timed state,
    seconds of a start-up on a CPU); with paged KV the prompt itself, which takes its pages."""
    if engine.pages is None:
        return {"prompt": 1, "fill": _timing_prompt(engine)}
    return {"prompt": _timing_prompt(engine)}


def _reachable(buckets, most: int) -> tuple[list[int], list[int]]:
    """(buckets a round of drafts alone lands in: those under `most` tokens and the first that
    holds it; the ones beyond, which only prompt chunks reach)."""
    bs = sorted(int(b) for b in buckets)
    top = next((b for b in bs if b >= most), bs[-1])
    return [b for b in bs if b <= top], [b for b in bs if b > top]


def own_table(engine, *, repeats: int = DEFAULT_REPEATS, sampling: SamplingParams | None = None,
              reuse: bool = True) -> OwnTable:
    """`engine`'s cost table: read back from the user cache when one was measured for the same key
    (and `reuse`), else measured now on its compiled programs and written there."""
    sampling = sampling or SamplingParams()
    key = table_key(engine, sampling)
    path = table_path(key)
    if reuse and path.exists():
        try:
            d = load_cost_file(path, expect_backend=key["backend"], expect_buckets=engine.priced_buckets)
            if d.get("key") == key:
                return OwnTable(_as_table(d), "read back", path, int(d["measure"]["repeats"]), 0.0)
            log.warning("own cost table %s was written for another key: measuring again", path)
        except (CostTableError, KeyError, TypeError) as e:
            log.warning("own cost table %s is unreadable (%s): measuring again", path, e)
    t0 = time.perf_counter()
    timed, beyond = _reachable(engine.priced_buckets, engine.R * (engine.G + 1))
    res = measure_engine(engine, repeats=repeats, warmup=0, warm_programs=True, draft="skip", stat="median",
                         sampling=sampling, buckets=timed, state=_timing_state(engine))
    seconds = time.perf_counter() - t0
    extra = {} if "t_skip" not in res else {"t_skip": res["t_skip"]}
    # buckets beyond the largest that drafts alone fill (rounds there carry prompt chunks): priced
    # in proportion to their tokens from the largest timed one
    last_b, last_t = res["buckets"][-1], res["t_verify"][-1]
    t_verify = res["t_verify"] + [last_t * b / last_b for b in beyond]
    d = save_cost_file(
        path, [*res["buckets"], *beyond], t_verify, res["t_draft"], backend=key["backend"],
        device_kind=key["device_kind"],
        provenance=(f"measured by the engine on its own compiled programs at start-up ({key['backend']}, "
                    f"{key['device_kind']}): t_verify(b) = the round landing in bucket b minus "
                    + ("the draft alone" if res["draft_from"] == "timer" else
                       "t_draft, what skipping the draft saves (the round with every slot active and no draft "
                       "verified minus the round that skips drafting)")
                    + f", median of {repeats} sweeps of the buckets after one untimed call of each program"
                    + (f"; {res['repriced']} repriced (a larger bucket measured cheaper, not in every sweep)"
                       if res["repriced"] else "")
                    + (f"; buckets {beyond} (prompt chunks only) in proportion to tokens from {last_b}"
                       if beyond else "")),
        measured_on=MEASURED_ON, t_round=res["t_round"], t_draft_paired=res["t_draft_paired"], plan=res["plan"],
        clipped=res["clipped"], repriced=res["repriced"], extrapolated=beyond,
        engine={"num_slots": engine.R, "gamma": engine.G, "mode": engine.mode, "max_len": engine.S},
        measure={"repeats": repeats, "warmup": "one call of each program", "draft": res["draft_from"],
                 "stat": "median", "seconds": seconds, "first_calls_seconds": res["warm_seconds"],
                 "when": time.strftime("%Y-%m-%d %H:%M:%S")}, key=key, **extra)
    return OwnTable(_as_table(load_cost_file(d)), "measured", path, repeats, seconds, res["warm_seconds"])
