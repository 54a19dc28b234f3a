"""The measured half of `bench roofline`: this device's memory bandwidth and matmul rate, and the
engine's decode programs timed on random models of a preset's shapes (weights' values do not
change a program's time), each beside its roofline (bench/roofline_model.py).

The caches are filled to the context without forwarding it: a short prompt is prefilled, then
every row's length and position are moved to the fill, so attention reads (and masks) that many
keys of the cache's contents, whatever they are. Forwarding a whole context per slot would cost
minutes on a CPU and tell nothing more about the decode programs' time.
"""

from __future__ import annotations

import gc
import time

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.bench import roofline_model as rm
from dspark_jax.config import served_config
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.drafter import registry
from dspark_jax.drafter.kinds.block import DSPARK
from dspark_jax.engine import rows as join
from dspark_jax.engine.buckets import bucket_for
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.drafter_fit import draft_shape
from dspark_jax.engine.engine import Engine
from dspark_jax.engine.timing import engine_draft_timer, prefilled_state
from dspark_jax.scheduler.costs import MeasureError, bucket_plan
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

__all__ = ["device_rates", "best_rates", "random_models", "measure_programs", "memory_stats", "best_of", "live_bytes",
           "free", "round_timing"]

MIB = 2 ** 20


def best_of(call, repeats: int, prepare=None) -> dict:
    """Seconds of `call(prepare())` after one untimed call (the compile): best and median of
    `repeats`, each blocked until its results are ready; `prepare` (untimed) makes fresh inputs
    for programs that donate theirs."""
    ts = []
    for i in range(repeats + 1):
        arg = jax.block_until_ready(prepare()) if prepare is not None else None
        t0 = time.perf_counter()
        jax.block_until_ready(call(arg))
        if i:
            ts.append(time.perf_counter() - t0)
    return _summary(ts)


def _summary(ts) -> dict:
    return {"best_s": float(min(ts)), "median_s": float(np.median(ts)), "repeats": len(ts)}


def device_rates(dtype, copy_mib: int = 256, matmul_n: int = 2048, repeats: int = 5) -> dict:
    """This device's rates, measured now: a copy of `copy_mib` MiB into a buffer the call donates
    (reads N bytes and writes N: no page of the output is touched for the first time while timed),
    a read-only stream (a sum over the same N bytes), and an [n, n] x [n, n] product in `dtype`.
    The bandwidth a roofline uses is the larger of the copy's traffic (read + written) / time and
    the stream's bytes read / time: a read-bound program can move bytes at least that fast."""
    n_bytes = int(copy_mib) * MIB
    src = jnp.ones((n_bytes // 4,), jnp.float32)
    box = {"dst": jnp.zeros_like(src)}
    copy = jax.jit(lambda s, d: d.at[:].set(s), donate_argnums=1)

    def copy_once(_):
        box["dst"] = copy(src, box["dst"])
        return box["dst"]

    c = best_of(copy_once, repeats)
    total, matmul = jax.jit(jnp.sum), jax.jit(jnp.matmul)  # wrapped once, outside the timed calls
    r = best_of(lambda _: total(src), repeats)
    del box["dst"]
    a = jnp.ones((matmul_n, matmul_n), dtype)
    mm = best_of(lambda _: matmul(a, a), repeats)
    copy_traffic = 2 * n_bytes / c["best_s"]
    return {"copy_bytes": n_bytes, "copy_s": c["best_s"], "copy_rate": n_bytes / c["best_s"],
            "copy_traffic": copy_traffic, "read_s": r["best_s"], "read_rate": n_bytes / r["best_s"],
            "bandwidth": max(copy_traffic, n_bytes / r["best_s"]),
            "matmul_n": matmul_n, "matmul_dtype": jnp.dtype(dtype).name, "matmul_s": mm["best_s"],
            "flop_rate": 2.0 * matmul_n ** 3 / mm["best_s"],
            "counted": "copy: N bytes read + N written per call (the destination donated); read: N bytes "
                       "summed; bandwidth = max(copy traffic, read rate); matmul: 2 n^3 FLOPs, best of the repeats"}


def best_rates(*measured: dict) -> dict:
    """The best of several `device_rates` measurements (before and after the programs, on a host
    other work shares): a roofline is a bound, so each rate is the highest this run saw."""
    out = dict(measured[0])
    for k in ("copy_rate", "copy_traffic", "read_rate", "bandwidth", "flop_rate"):
        out[k] = max(m[k] for m in measured)
    for k in ("copy_s", "read_s", "matmul_s"):
        out[k] = min(m[k] for m in measured)
    out["measurements"] = len(measured)
    return out


def random_models(preset: str | None, dtype, gamma: int | None):
    """(target, drafter, name): random models of `preset`'s target and drafter (a DSpark / DFlash
    drafter section), or of the tiny test shapes for preset None."""
    f32 = jnp.dtype(dtype) == jnp.float32
    if preset is None:
        target = tiny_target(tiny_config(), param_dtype=dtype)
        return target, tiny_drafter(DSPARK.name, target, gamma=gamma or 7, dtype=None if f32 else dtype), "tiny"
    cfg = served_config(preset, gamma=gamma)
    if cfg.drafter.kind not in rm.BLOCK_KINDS:
        raise ValueError(f"{preset}'s drafter is {cfg.drafter.kind!r}: the roofline arithmetic knows the block "
                         f"drafters ({', '.join(rm.BLOCK_KINDS)}); use a *_dspark or *_dflash preset")
    target = tiny_target(cfg.target.model, param_dtype=dtype)
    drafter = tiny_drafter(cfg.drafter.kind, target, dcfg=cfg.drafter, dtype=None if f32 else dtype)
    return target, drafter, str(preset)


def memory_stats(jitted, *args) -> dict:
    """The compiled program's `memory_analysis()` (bytes): the engine's own jitted program lowered
    for these arguments (the executable its calls run, from jit's cache)."""
    m = jitted.lower(*args).compile().memory_analysis()
    return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
            "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}


def repeated(timer, repeats: int) -> dict:
    """`timer() -> seconds` (one call, e.g. engine/timing.py's round and draft timers) called once
    untimed (the compile) and `repeats` times: best and median."""
    return _summary([timer() for _ in range(repeats + 1)][1:])


def live_bytes() -> int:
    """Bytes of every array alive on the devices now, after a garbage collection (so the arrays
    only cycles kept are gone)."""
    gc.collect()
    return sum(int(a.nbytes) for a in jax.live_arrays())


def free(*trees) -> None:
    """Delete every device array of `trees` once what was queued on them is done: decode states
    the measurement made and holds no other reference to (a state is the size of the caches:
    19 GB for Qwen3-8B at 64 slots x 2048 tokens in bf16)."""
    for a in jax.tree.leaves(trees):
        if isinstance(a, jax.Array) and not a.is_deleted():
            jax.block_until_ready(a)
            a.delete()


def measure_programs(target, drafter, *, slots: int, context: int, fill: float, prompt: int, repeats: int,
                     temperature: float = 0.0, say=print) -> dict:
    """Every decode program of an engine of `slots` x `context` timed, with its footprint and
    compiled memory: the target-only step, the round at each verification bucket, the draft alone
    and a prefill of `prompt`-token prompts. -> {"fill", "prompt", "gamma", "programs": [...],
    "memory", "live_bytes"}.

    One engine at a time and one decode state at a time: the target-only engine is measured and
    dropped before the DSpark one is built (both read the model's one copy of the target's
    weights, target/decode_weights.py), every timed call takes a fresh state the program donates
    (`round_timing`) or the one state its timer holds, dropped before the next program's is made,
    and the compiled memory is read from the state's shapes, not from a state.
    `live_bytes` records the device bytes alive after each program, its states freed: the
    weights (and the DSpark engine's drafter arrays) and nothing that grows per program."""
    kind = registry.kind_of(drafter)
    G = draft_shape(kind, drafter, target, None, None).G
    if context - G - 2 < 1:
        raise ValueError(f"--context {context} leaves no room for a round of gamma {G}")
    n_fill = max(int(fill * (context - G - 2)), 1)
    prompt = max(min(prompt, n_fill), kind.min_prompt_len, 2)
    sp = SamplingParams(temperature, 0, 1.0)
    progs, mem, live = [], {}, {}

    def add(fp, timing, memory_key):
        say(f"[roofline] {fp.name}: best {1e3 * timing['best_s']:.3f} ms, median {1e3 * timing['median_s']:.3f} ms "
            f"over {timing['repeats']}")
        progs.append({"footprint": fp, "timing": timing, "memory": memory_key})

    ar = Engine(target, None, EngineConfig(num_slots=slots, max_len=context, buckets=(slots,)))
    st0, c0 = ar.state_shape, ar.control(sp)  # the shapes the programs run on (memory, footprints)
    m_ar = rm.model_shapes(ar.spec, ar.tp, {}, st0)
    add(rm.target_step(m_ar, slots, n_fill, f"target_step@{slots}"),
        round_timing(ar, sp, slots, (slots, 0), repeats, prompt=min(prompt, 16), fill=n_fill), "target_step")
    mem["target_step"] = memory_stats(ar._round, ar.tp, ar.dp, st0, c0)
    del ar
    live["target_step"] = live_bytes()

    ds = Engine(target, drafter, EngineConfig(num_slots=slots, max_len=context, policy="fixed"))
    st = ds.state_shape
    m = rm.model_shapes(ds.spec, ds.tp, rm.named_leaves(ds.dp), st)
    for b, (k, g) in sorted(bucket_plan(ds.priced_buckets, ds.R, ds.G).items()):
        add(rm.round_footprint(m, k, g, n_fill, f"round@{b}"),
            {**round_timing(ds, sp, b, (k, g), repeats, prompt=prompt, fill=n_fill), "bucket": b}, "round")
        live[f"round@{b}"] = live_bytes()
    mem["round"] = memory_stats(ds._round, ds.tp, ds.dp, st, ds.control(sp))
    draft_fn = engine_draft_timer(ds, sp, prompt=prompt, fill=n_fill)
    add(rm.draft_footprint(m, slots, n_fill), repeated(draft_fn, repeats), "draft")
    del draft_fn
    live["draft"] = live_bytes()
    mem["draft"] = memory_stats(ds._draft, ds.dp, st, ds.control(sp).sampling)
    fp, timing, mem["prefill"] = _prefill(ds, m, slots, prompt, repeats)
    add(fp, timing, "prefill")
    live["prefill"] = live_bytes()
    return {"fill": n_fill, "prompt": prompt, "gamma": ds.G, "buckets": list(ds.priced_buckets),
            "programs": progs, "memory": mem, "live_bytes": live}


def round_timing(eng, sampling, bucket: int, plan: tuple[int, int], repeats: int, **state) -> dict:
    """`best_of` the engine's round (`Engine.step`) with `plan` = (k active slots, g drafts each
    verified, pinned: `Control.pin`), which lands in `bucket`; each call from a state prefilled
    for it (`prefilled_state` with `state`'s prompt / fill, made untimed), which the round
    donates: one decode state is held at a time, where a timer that copies one kept template
    state would hold two. A round that lands in another bucket raises MeasureError."""
    k, g = plan
    ctl = eng.control(sampling, gamma=g, pin=g, table=eng.unpriced_table)
    landed = []

    def call(st):
        st, out = eng.step(st, ctl)
        landed.append(out.bucket)
        return st, out

    timing = best_of(call, repeats, prepare=lambda: prefilled_state(eng, k, **state))
    got = {int(b) for b in landed}
    if got != {eng.buckets.index(bucket)}:
        raise MeasureError(f"the round timed for bucket {bucket} ({k} active slots x (1 + {g}) tokens) ran in "
                           f"bucket(s) {sorted(eng.buckets[i] for i in got)}")
    return timing


def _prefill(eng, m, slots, prompt, repeats):
    """(footprint, timing, memory) of the engine's prefill program for `prompt`-token prompts in
    every slot, from a fresh state each call (the prefill donates it)."""
    P = bucket_for(eng.prefill_buckets, prompt)
    V = eng.target.cfg.vocab_size
    prompts = [[(5 * i + j + 2) % V for j in range(prompt)] for i in range(slots)]
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(1), slots)))
    st = eng.init_state()
    args = join.join_rows(eng.R, st, P, list(range(slots)), prompts, kd, [eng.S] * slots)
    free(st)
    # each call donates its fresh state and its output is dropped as it returns: one state held
    timing = best_of(lambda s: eng._prefill(eng.tp, eng.dp, s, *args), repeats, prepare=eng.init_state)
    memory = memory_stats(eng._prefill, eng.tp, eng.dp, eng.state_shape, *args)
    return rm.prefill_footprint(m, slots, prompt, f"prefill@{P}"), timing, memory
