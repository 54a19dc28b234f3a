"""A cost table that follows the load: the rounds a server runs anyway, timed as they run.

A table measured at start-up (engine/own_costs.py) or by `costs measure` prices rounds on a quiet
machine; a busy one (other processes, a hotter chip, the serving loop's own host work) runs them
slower, and by different amounts per bucket. `LiveTable` keeps, per priced bucket, the wall times
of the last `window` rounds that landed there, drafted and skipped apart, and every `every` rounds
rebuilds the table from their medians (once a bucket has `least` of them): t_verify(b) = the
drafted rounds' median at b less the draft's time (which a round cannot separate from its
verification, so it stays as measured), and the skipped rounds' price beyond t_verify (the
table's `skip_extra`, at most the draft's) from theirs. A bucket too few rounds landed in keeps
its measured time. A round that takes more than `outlier` times what the table says (a compile, a
pause) is left out.
The rebuilt table keeps the measured order of the buckets (`_in_measured_order`): a round runs in
the bucket its table prices cheapest among those that hold its tokens, so a median that put a
larger bucket below a smaller one would move rounds there on the strength of one busy window.
`changes` says what moved.
"""

from __future__ import annotations

import collections
import logging

import numpy as np

from dspark_jax.scheduler.costs import FLOOR_S
from dspark_jax.scheduler.prefix import CostTable, make_table

__all__ = ["LiveTable"]

log = logging.getLogger(__name__)


class LiveTable:
    """Running per-bucket round times over `table` (a CostTable) for an engine compiling `buckets`
    (the compiled buckets, whose indices rounds report; chunk-only ones are not priced)."""

    def __init__(self, table: CostTable, buckets, *, window: int = 16, least: int = 4, every: int = 32,
                 outlier: float = 10.0, moved: float = 0.05):
        self.priced = [int(b) for b in np.asarray(table.buckets)]
        self.t_verify = np.asarray(table.t_verify, np.float64).copy()
        self.t_draft = float(np.asarray(table.t_draft))
        self.skip_extra = 0.0 if table.skip_extra is None else float(np.asarray(table.skip_extra))
        self.measured = self.t_verify.copy()  # what the table said before any round
        self.measured_skip_extra = self.skip_extra
        self._index = {i: self.priced.index(int(b)) for i, b in enumerate(buckets) if int(b) in self.priced}
        self.least, self.every, self.outlier, self.moved = int(least), int(every), float(outlier), float(moved)
        self.drafted = [collections.deque(maxlen=window) for _ in self.priced]  # drafted rounds' seconds
        self.skipped = [collections.deque(maxlen=window) for _ in self.priced]  # ... and skipped rounds'
        self.rounds = 0
        self.updates = 0

    def observe(self, bucket_index: int, drafted: bool, seconds: float) -> None:
        """One round that landed in compiled bucket `bucket_index`, drafting or not, took `seconds`."""
        i = self._index.get(int(bucket_index))
        if i is None:
            return
        predicted = self.t_verify[i] + (self.t_draft if drafted else self.skip_extra)
        if not seconds > 0 or seconds > self.outlier * predicted:
            return
        (self.drafted if drafted else self.skipped)[i].append(float(seconds))
        self.rounds += 1

    def _medians(self, times) -> np.ndarray:
        return np.asarray([np.median(t) if len(t) >= self.least else np.nan for t in times])

    def refreshed(self) -> CostTable | None:
        """Every `every` observed rounds, the table rebuilt from the rounds' medians when a price
        moved by more than `moved` (relative); else None."""
        if not self.rounds or self.rounds % self.every:
            return None
        drafted, skipped = self._medians(self.drafted), self._medians(self.skipped)
        t_verify = np.where(np.isnan(drafted), self.t_verify, np.maximum(drafted - self.t_draft, FLOOR_S))
        t_verify = _in_measured_order(t_verify, self.measured, ~np.isnan(drafted))
        seen = ~np.isnan(skipped)
        # a round that skips drafting does less than one that drafts in the same bucket: its extra
        # beyond t_verify is at most the draft (more would make a draft that cannot pay look cheaper
        # than not drafting; the skipped rounds' medians swing with the load, the draft's price does not)
        skip_extra = min(float(np.mean(np.maximum(skipped[seen] - t_verify[seen], 0.0))), self.t_draft) if seen.any() \
            else self.skip_extra
        old = np.append(self.t_verify, self.skip_extra + 1e-12)
        new = np.append(t_verify, skip_extra + 1e-12)
        if np.max(np.abs(new / old - 1.0)) <= self.moved:
            return None
        self.t_verify, self.skip_extra = t_verify, skip_extra
        self.updates += 1
        log.info("cost table follows the load (%d rounds): %s", self.rounds, self.changes())
        return self.table()

    def table(self) -> CostTable:
        return make_table(self.priced, t_verify=self.t_verify, t_draft=self.t_draft, skip_extra=self.skip_extra)

    def changes(self) -> str:
        """Each price now against the one measured, e.g. "8: 1.20 -> 1.45 ms, skipped round's
        extra: 0.5 -> 0.9 ms"."""
        parts = [f"{b}: {1e3 * m:.3g} -> {1e3 * t:.3g} ms" for b, m, t in zip(self.priced, self.measured, self.t_verify)
                 if abs(t / m - 1.0) > 1e-9]
        if abs(self.skip_extra - self.measured_skip_extra) > 1e-12:
            was, now = 1e3 * self.measured_skip_extra, 1e3 * self.skip_extra
            parts.append(f"skipped round's extra: {was:.3g} -> {now:.3g} ms")
        return ", ".join(parts) or "unchanged"


def _in_measured_order(t, measured, observed) -> np.ndarray:
    """`t` (per priced bucket, ascending) with every pair the measured table priced in order (the
    smaller bucket no dearer) kept in order: a bucket no round reached rises to the price of a
    smaller one above it (the load that raised one raised the other), then a bucket priced above a
    larger one takes that one's price (the tie sends rounds to the smaller bucket). Pairs the
    measured table priced out of order (a larger bucket cheaper in every sweep of its measurement:
    scheduler/costs.py `measure_table`) stay free."""
    t = np.asarray(t, np.float64).copy()
    n = len(t)
    ordered = lambda i, j: measured[i] <= measured[j]
    for j in range(n):
        if not observed[j]:
            t[j] = max([t[j]] + [t[i] for i in range(j) if ordered(i, j)])
    for i in reversed(range(n)):
        t[i] = min([t[i]] + [t[j] for j in range(i + 1, n) if ordered(i, j)])
    return t
