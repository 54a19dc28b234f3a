"""The TPU compiler's time estimate of a compiled program, with loops counted as they run.

Each instruction of a program compiled by XLA:TPU carries its cost model's `estimated_cycles`.
Summing them as the program runs (a `while` body times its trip count, read from the loop
condition's bound; a `conditional` by its costliest branch; fusions priced as one instruction)
and dividing by the chip's clock gives one chip's time:

    seconds = weighted_cycles / clock

`compiled.cost_analysis()["optimal_seconds"]` is not used for the total: it counts every loop
body once (a 36-layer target written as a `lax.scan` over layers is priced as one layer) and
turns negative where it meets instructions it cannot price (about -1 s each, e.g. SparseCore
calls). The clock is the compiler's
own: cycles over `optimal_seconds` of a compute-bound bf16 product compiled for the same chip
(`chip_clock_hz`), where the cycles are the matrix units' and the seconds flops over the chip's
peak. That clock is uncertain: a weight-read-bound product gives 1.0-1.7x it on v6e / v5p /
v7x and 1/28 of it on v5e, whose weight-read-bound cycle estimates fall far below its HBM time.
Absolute times carry that uncertainty; ratios of programs compiled for one chip (speedups,
K-flatness) do not depend on it. Collectives carry no cycle estimate: they are counted
(`collectives`, weighted like the rest) and left to the caller's overhead model, as are host
overhead and launch latency. A loop whose bound is not a constant is counted once and listed in `unknown_loops`.
Whether a Pallas kernel's call is priced by the `pl.CostEstimate` it declares is not checked.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["ProgramCost", "program_cost", "hlo_cycles", "chip_clock_hz"]

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_ATTR = {name: re.compile(rf"\b{name}=%?([\w.\-]+)") for name in ("condition", "body", "to_apply", "calls")}
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_CONSTANT = re.compile(r"^\s*%?([\w.\-]+) = \S+ constant\((-?\d+)\)")
_COMPARE = re.compile(r"compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=(LT|GT)")
_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([\d,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}
_COLLECTIVES = ("all-reduce", "all-reduce-start", "all-gather", "all-gather-start", "reduce-scatter",
                "all-to-all", "collective-permute", "collective-permute-start")


@dataclasses.dataclass(frozen=True)
class ProgramCost:
    seconds: float  # weighted cycles / clock: one chip's time, collectives and overheads not included
    cycles: int  # estimated cycles with loop bodies counted trip-count times
    once_cycles: int  # every estimate counted once
    clock_hz: float
    optimal_seconds: float  # cost_analysis()'s figure (loop bodies once; negative with SparseCore offload)
    flops: float  # cost_analysis(), loop bodies once
    bytes_accessed: float
    collectives: int  # collective ops as the program runs (loop bodies trip-count times)
    collective_bytes: int  # their result bytes
    loops: tuple[tuple[str, int], ...]  # (body computation, trip count) of every while loop
    unknown_loops: tuple[str, ...]  # loops whose trip count is not a constant (counted once)


def _split(hlo: str) -> tuple[dict[str, list[str]], str]:
    comps, entry, cur = {}, "", None
    for line in hlo.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            cur = m.group(1)
            comps[cur] = []
            if line.startswith("ENTRY"):
                entry = cur
        elif cur is not None and line.strip() == "}":
            cur = None
        elif cur is not None and line.strip():
            comps[cur].append(line)
    return comps, entry


def _trip_count(cond: list[str]) -> int | None:
    """The bound of `i < N` (or N > i) in a loop condition whose counter starts at 0 and steps by
    one, as lax.scan and fori_loop compile; None when the bound is not a constant."""
    consts = {}
    for line in cond:
        m = _CONSTANT.match(line)
        if m:
            consts[m.group(1)] = int(m.group(2))
    root = next((ln for ln in cond if ln.lstrip().startswith("ROOT")), "")
    m = _COMPARE.search(root)
    if not m:
        return None
    a, b, d = m.groups()
    if d == "LT" and b in consts:
        return consts[b]
    if d == "GT" and a in consts:
        return consts[a]
    return None


def _result_bytes(type_text: str) -> int:
    return sum(_BYTES[t] * int(np.prod([int(x) for x in dims.split(",") if x] or [1]))
               for t, dims in _ARRAY.findall(type_text))


def hlo_cycles(hlo: str) -> dict:
    """{"cycles", "once_cycles", "collectives", "collective_bytes", "loops", "unknown_loops"} over
    the computations the entry runs (a fusion is priced by its instruction, not entered)."""
    comps, entry = _split(hlo)
    loops, unknown = [], []
    memo: dict[str, np.ndarray] = {}  # per computation: (cycles, once, collectives, collective bytes)

    def cost(name: str) -> np.ndarray:
        if name in memo:
            return memo[name]
        memo[name] = np.zeros(4, np.int64)  # recursion guard
        total = np.zeros(4, np.int64)
        for line in comps.get(name, []):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            type_text, op = m.group(2), m.group(3)
            c = _CYCLES.search(line)
            if c:
                total[:2] += int(c.group(1))
            if op in _COLLECTIVES:
                total[2:] += (1, _result_bytes(type_text))
            if op == "while":
                body, cond = _ATTR["body"].search(line), _ATTR["condition"].search(line)
                n = _trip_count(comps.get(cond.group(1), [])) if cond else None
                b = cost(body.group(1)) if body else np.zeros(4, np.int64)
                if n is None:
                    unknown.append(body.group(1) if body else m.group(1))
                    n = 1
                else:
                    loops.append((body.group(1) if body else m.group(1), n))
                total += n * b * np.array([1, 0, 1, 1])
                total[1] += b[1]
            elif op == "conditional":
                br = _BRANCHES.search(line)
                costs = [cost(x.strip().lstrip("%")) for x in br.group(1).split(",")] if br else []
                if costs:
                    worst = max(costs, key=lambda x: x[0])
                    total += worst * np.array([1, 0, 1, 1])
                    total[1] += sum(x[1] for x in costs)
            elif op in ("call", "async-start"):
                callee = _ATTR["to_apply"].search(line) or _ATTR["calls"].search(line)
                if callee:
                    total += cost(callee.group(1))
        memo[name] = total
        return total

    cycles, once, n_coll, coll_bytes = (int(x) for x in cost(entry))
    return {"cycles": cycles, "once_cycles": once, "collectives": n_coll, "collective_bytes": coll_bytes,
            "loops": loops, "unknown_loops": unknown}


def _analysis(compiled) -> dict:
    ca = compiled.cost_analysis()
    return ca[0] if isinstance(ca, (list, tuple)) else ca


_CLOCKS: dict[tuple[str, str], float] = {}  # (platform, device kind) -> Hz: one calibration compile per chip


def _clock(device) -> float:
    mesh = Mesh(np.array([device]), ("x",))
    rep = NamedSharding(mesh, P())
    x = jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16, sharding=rep)
    w = jax.ShapeDtypeStruct((4096, 8192), jnp.bfloat16, sharding=rep)
    with jax.set_mesh(mesh):  # its own chip, whatever mesh the caller has set
        compiled = jax.jit(lambda a, b: a @ b).lower(x, w).compile()
    return hlo_cycles(compiled.as_text())["once_cycles"] / float(_analysis(compiled)["optimal_seconds"])


def chip_clock_hz(device) -> float:
    """Cycles per second of the compiler's cost model for `device`'s chip: the estimated cycles of
    a bf16 [4096, 4096] x [4096, 8192] product (compute bound) over its `optimal_seconds`."""
    key = (device.platform, device.device_kind)
    if key not in _CLOCKS:
        _CLOCKS[key] = _clock(device)
    return _CLOCKS[key]


def program_cost(compiled, device) -> ProgramCost:
    """The estimate of one program compiled for `device`'s chip; see the module doc."""
    ca = _analysis(compiled)
    h = hlo_cycles(compiled.as_text())
    clock = chip_clock_hz(device)
    return ProgramCost(seconds=h["cycles"] / clock, cycles=h["cycles"], once_cycles=h["once_cycles"], clock_hz=clock,
                       optimal_seconds=float(ca.get("optimal_seconds", float("nan"))),
                       flops=float(ca.get("flops", 0.0)), bytes_accessed=float(ca.get("bytes accessed", 0.0)),
                       collectives=h["collectives"], collective_bytes=h["collective_bytes"],
                       loops=tuple(h["loops"]), unknown_loops=tuple(h["unknown_loops"]))
