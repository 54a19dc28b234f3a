"""Where a compiled TPU program's estimated time goes, instruction by instruction.

`tpu_cost.program_cost` sums the compiler's `estimated_cycles` into one figure; this lists them
grouped by instruction name (less its number: the same op of every unrolled layer falls in one
group) and result type, costliest first, so a step far from its floor shows what it spends the
rest on: weight copies (`copy bf16[1536,4096]`), small fusions a layer, the products themselves.
Loop bodies count their trip count times; every branch of a conditional is listed (program_cost
counts only the costliest); a Pallas call is priced from its declared cost as program_cost prices
it (`kernel_cycles`, `tpu_cost.kernel_pricer`).
"""

from __future__ import annotations

import collections
import re

from dspark_jax.parallel.tpu_cost import (
    _ATTR,
    _BRANCHES,
    _CYCLES,
    _INSTRUCTION,
    _KERNEL_COST,
    _split,
    _trip_count,
)

__all__ = ["instruction_breakdown"]

_NUMBER = re.compile(r"[.\d]+$")


def instruction_breakdown(hlo: str, clock_hz: float, top: int = 20, kernel_cycles=None) -> list[tuple[float, str, str]]:
    """[(seconds, instruction group, result type)] of a compiled program's text, the `top`
    costliest groups first; `kernel_cycles(flops, transcendentals, bytes)` prices Pallas calls
    (without it they are left out)."""
    comps, entry = _split(hlo)
    groups: collections.Counter = collections.Counter()

    def walk(name: str, times: int, seen: tuple[str, ...]) -> None:
        if name in seen:
            return
        for line in comps.get(name, []):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            op = m.group(3)
            key = (_NUMBER.sub("", m.group(1)), m.group(2)[:90])
            if c := _CYCLES.search(line):
                groups[key] += int(c.group(1)) * times
            elif kernel_cycles and op == "custom-call" and (k := _KERNEL_COST.search(line)):
                flops, transcendentals, nbytes = (int(x) for x in k.groups())
                groups[key] += int(round(kernel_cycles(flops, transcendentals, nbytes))) * times
            if op == "while":
                body, cond = _ATTR["body"].search(line), _ATTR["condition"].search(line)
                n = (_trip_count(comps.get(cond.group(1), [])) if cond else None) or 1
                if body:
                    walk(body.group(1), times * n, (*seen, name))
            elif op == "conditional" and (br := _BRANCHES.search(line)):
                for branch in br.group(1).split(","):
                    walk(branch.strip().lstrip("%"), times, (*seen, name))
            elif op in ("call", "async-start"):
                if callee := (_ATTR["to_apply"].search(line) or _ATTR["calls"].search(line)):
                    walk(callee.group(1), times, (*seen, name))

    walk(entry, 1, ())
    return [(cycles / clock_hz, group, kind) for (group, kind), cycles in groups.most_common(top)]
