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
An asynchronous `call-start` on another execution thread (TPU7x's SparseCores run its all-reduces
so) adds its collectives to the count but not its cycles, which overlap the caller's.

A Pallas (Mosaic) kernel's call carries no cycle estimate, only the `pl.CostEstimate` it declares.
The cost model prices such a call as the slowest of its three declared amounts at the chip's rates,
``max(flops / F, bytes / B, transcendentals / T)``; the rates are read from the compiler itself
(`kernel_rates`: the `optimal_seconds` of a trivial kernel declaring one amount at a time), and the
call is counted at that time times the clock (`kernels` counts the calls priced so).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["ProgramCost", "program_cost", "hlo_cycles", "chip_clock_hz", "kernel_rates", "kernel_pricer"]

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")
_CYCLES = re.compile(r'"estimated_cycles":"(\d+)"')
_ATTR = {name: re.compile(rf"\b{name}=%?([\w.\-]+)") for name in ("condition", "body", "to_apply", "calls")}
_KERNEL_COST = re.compile(r'"cost_estimate":\{"flops":"(\d+)","transcendentals":"(\d+)","bytes_accessed":"(\d+)"')
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
    kernels: int = 0  # Pallas calls as the program runs, priced from their declared cost estimate
    kernel_cycles: int = 0  # the part of `cycles` priced from kernels' declared cost estimates
    collective_seconds: float = 0.0  # the collectives under a stated model (parallel/collectives.py), not in `seconds`


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


def hlo_cycles(hlo: str, kernel_cycles=None, collective_seconds=None) -> dict:
    """{"cycles", "once_cycles", "collectives", "collective_bytes", "kernels", "kernel_cycles",
    "collective_seconds", "loops", "unknown_loops"} over the computations the entry runs (a fusion is
    priced by its instruction, not entered). `kernel_cycles(flops, transcendentals, bytes) -> cycles`
    prices a kernel call from its declared cost estimate; without it such calls count 0 cycles (and
    are still counted). `collective_seconds(op, result bytes, instruction line) -> seconds` prices
    each collective as it runs (kept apart from the cycles)."""
    comps, entry = _split(hlo)
    loops, unknown = [], []
    # per computation: (cycles, once, collectives, coll. bytes, kernels, kernel cycles, collective ns)
    memo: dict[str, np.ndarray] = {}
    zero = lambda: np.zeros(7, np.int64)
    per_run = np.array([1, 0, 1, 1, 1, 1, 1])  # what a loop's trip count multiplies (not the once-counted cycles)

    def cost(name: str) -> np.ndarray:
        if name in memo:
            return memo[name]
        memo[name] = zero()  # recursion guard
        total = zero()
        for line in comps.get(name, []):
            m = _INSTRUCTION.match(line)
            if not m:
                continue
            type_text, op = m.group(2), m.group(3)
            c = _CYCLES.search(line)
            if c:
                total[:2] += int(c.group(1))
            elif op == "custom-call" and (k := _KERNEL_COST.search(line)):
                flops, transcendentals, nbytes = (int(x) for x in k.groups())
                kc = int(round(kernel_cycles(flops, transcendentals, nbytes))) if kernel_cycles else 0
                total[:2] += kc
                total[4:6] += (1, kc)
            if op in _COLLECTIVES:
                nbytes = _result_bytes(type_text)
                total[2:4] += (1, nbytes)
                if collective_seconds is not None:
                    total[6] += int(round(1e9 * collective_seconds(op, nbytes, line)))
            if op == "while":
                body, cond = _ATTR["body"].search(line), _ATTR["condition"].search(line)
                n = _trip_count(comps.get(cond.group(1), [])) if cond else None
                b = cost(body.group(1)) if body else zero()
                if n is None:
                    unknown.append(body.group(1) if body else m.group(1))
                    n = 1
                else:
                    loops.append((body.group(1) if body else m.group(1), n))
                total += n * b * per_run
                total[1] += b[1]
            elif op == "conditional":
                br = _BRANCHES.search(line)
                costs = [cost(x.strip().lstrip("%")) for x in br.group(1).split(",")] if br else []
                if costs:
                    worst = max(costs, key=lambda x: x[0])
                    total += worst * per_run
                    total[1] += sum(x[1] for x in costs)
            elif op in ("call", "async-start"):
                callee = _ATTR["to_apply"].search(line) or _ATTR["calls"].search(line)
                if callee:
                    total += cost(callee.group(1))
            elif op == "call-start" and (callee := _ATTR["to_apply"].search(line)):
                # an asynchronous call on another execution thread (TPU7x runs the all-reduces on its
                # SparseCores so): its collectives count, its cycles overlap the caller's and do not
                sub = cost(callee.group(1))
                total[2:4] += sub[2:4]
                total[6] += sub[6]
        memo[name] = total
        return total

    cycles, once, n_coll, coll_bytes, kernels, k_cycles, coll_ns = (int(x) for x in cost(entry))
    return {"cycles": cycles, "once_cycles": once, "collectives": n_coll, "collective_bytes": coll_bytes,
            "kernels": kernels, "kernel_cycles": k_cycles, "collective_seconds": coll_ns * 1e-9, "loops": loops,
            "unknown_loops": unknown}


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


_RATES: dict[tuple[str, str], tuple[float, float, float]] = {}


def _declared_seconds(device, flops: int, transcendentals: int, nbytes: int) -> float:
    def copy(x_ref, o_ref):
        o_ref[...] = x_ref[...]

    mesh = Mesh(np.array([device]), ("x",))
    x = jax.ShapeDtypeStruct((8, 128), jnp.float32, sharding=NamedSharding(mesh, P()))
    estimate = pl.CostEstimate(flops=flops, transcendentals=transcendentals, bytes_accessed=nbytes)
    call = lambda a: pl.pallas_call(copy, out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype), cost_estimate=estimate)(a)
    with jax.set_mesh(mesh):  # its own chip, whatever mesh the caller has set
        return float(_analysis(jax.jit(call).lower(x).compile())["optimal_seconds"])


def kernel_rates(device) -> tuple[float, float, float]:
    """(flops/s, bytes/s, transcendentals/s) at which the compiler prices a kernel's declared cost
    estimate on `device`'s chip: each from a trivial kernel declaring 10^13 flops, 10^9 bytes or
    10^10 transcendentals alone (its own 8 KiB of data is 10^-5 of the declared bytes)."""
    key = (device.platform, device.device_kind)
    if key not in _RATES:
        f, b, t = 10**13, 10**9, 10**10
        _RATES[key] = (f / _declared_seconds(device, f, 0, 0), b / _declared_seconds(device, 0, b, 0),
                       t / _declared_seconds(device, 0, 0, t))
    return _RATES[key]


def kernel_pricer(hlo: str, device, clock: float):
    """`kernel_cycles(flops, transcendentals, bytes) -> cycles` for the Pallas calls of `hlo`,
    priced as the cost model prices them (module docstring); None when it holds none."""
    if 'custom_call_target="tpu_custom_call"' not in hlo:
        return None
    rf, rb, rt = kernel_rates(device)
    return lambda f, t, b: clock * max(f / rf, b / rb, t / rt)


def program_cost(compiled, device, collective_seconds=None) -> ProgramCost:
    """The estimate of one program compiled for `device`'s chip; see the module doc.
    `collective_seconds`: a model pricing each collective (parallel/collectives.py), reported apart."""
    ca = _analysis(compiled)
    clock = chip_clock_hz(device)
    hlo = compiled.as_text()
    h = hlo_cycles(hlo, kernel_pricer(hlo, device, clock), collective_seconds)
    return ProgramCost(seconds=h["cycles"] / clock, cycles=h["cycles"], once_cycles=h["once_cycles"], clock_hz=clock,
                       optimal_seconds=float(ca.get("optimal_seconds", float("nan"))),
                       flops=float(ca.get("flops", 0.0)), bytes_accessed=float(ca.get("bytes accessed", 0.0)),
                       collectives=h["collectives"], collective_bytes=h["collective_bytes"], kernels=h["kernels"],
                       kernel_cycles=h["kernel_cycles"], collective_seconds=h["collective_seconds"],
                       loops=tuple(h["loops"]), unknown_loops=tuple(h["unknown_loops"]))
