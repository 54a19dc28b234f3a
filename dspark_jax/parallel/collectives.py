"""A stated price for the collectives of a program compiled for a TPU slice.

XLA:TPU's cost model gives collectives no cycle estimate (parallel/tpu_cost.py counts them and
leaves them out), yet a tensor-parallel decode step has two all-reduces a layer and, at one slot,
they are bound by latency rather than bytes. This prices each one with a model of our own, stated
here and reported apart from the compiler's figures:

    seconds = hops x HOP_LATENCY_S + bytes on the wire / ring bandwidth

- the group of n chips forms a ring over two of each chip's ICI ports (one each way), so the ring
  moves `ICI_GBPS x 2 / ICI_PORTS` a chip (parallel/slices.py, Cloud TPU's datasheet figures);
- an all-gather or reduce-scatter puts (n - 1) / n of the gathered array's bytes on the wire and
  takes n / 2 hops (the two directions halve the ring); an all-reduce is both, twice each;
  an all-to-all or a collective-permute moves its result's bytes once over one hop;
- `HOP_LATENCY_S`: about 1 us a hop, from "How to Scale Your Model" (Austin et al., Google
  DeepMind, 2025), "A note on ICI latency": one byte between two v5p chips costs as long as 45 kB.

No overlap with computation is assumed (XLA:TPU can overlap an async collective with independent
work; a decode step's all-reduces sit on its critical path). A model, not a measurement: a chip
decides.
"""

from __future__ import annotations

import re

from dspark_jax.parallel.slices import ICI_GBPS, ICI_PORTS

__all__ = ["HOP_LATENCY_S", "group_size", "collective_pricer"]

HOP_LATENCY_S = 1e-6

_IOTA_GROUPS = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_LIST_GROUPS = re.compile(r"replica_groups=\{\{([\d,]*)\}")


def group_size(line: str, default: int) -> int:
    """Chips in each of a collective instruction's replica groups (`default` when it names none)."""
    if m := _IOTA_GROUPS.search(line):
        return int(m.group(2))
    if m := _LIST_GROUPS.search(line):
        return len([x for x in m.group(1).split(",") if x])
    return default


def collective_pricer(generation: str, chips: int):
    """`price(op, result bytes, instruction line) -> seconds` for `generation`'s chips (None where
    the datasheet table has no ICI figure for it)."""
    if generation not in ICI_GBPS:
        return None
    ring = ICI_GBPS[generation] * 1e9 * 2 / ICI_PORTS[generation]

    def price(op: str, nbytes: int, line: str) -> float:
        n = group_size(line, chips)
        if n <= 1:
            return 0.0
        share = (n - 1) / n
        if op.startswith("all-reduce"):
            return 2 * (n / 2 * HOP_LATENCY_S + share * nbytes / ring)
        if op.startswith(("all-gather", "reduce-scatter")):
            full = nbytes * (n if op.startswith("reduce-scatter") else 1)
            return n / 2 * HOP_LATENCY_S + share * full / ring
        return HOP_LATENCY_S + nbytes / ring

    return price
