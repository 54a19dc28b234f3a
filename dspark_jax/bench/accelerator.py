"""First contact with an accelerator (`python -m dspark_jax bench accelerator`): what one run on a
machine never seen before must tell, with random weights of a preset's shapes and nothing
downloaded, within a time budget.

Stages, in the order they run (each one's text is emitted as it ends, the JSON document written
after every stage, so a run cut short keeps what it measured):

1. environment: the backend, device kind and count, jax / jaxlib / flax and the backend plugin
   (jax-cuda / libtpu), the plugin's platform version, the device's memory limit;
2. rates: this device's copy bandwidth and matmul rate in the run's dtype, measured now
   (bench/roofline_measure.py `device_rates`): every roofline below uses them;
3. kernel: the GPU cache-attention kernel (target/gpu_kernel.py, through
   target/paged_kernel.py's `dense_attention_lse` as the engine calls it) against the reference
   attention over the gathered cache, at each slot count's verification shape: equal outputs
   (max |difference| within a tolerance for the dtype) and both timed against the bytes of the
   keys they must read; off GPU the reference alone is timed;
4. target_step@R: a target-only engine's round (one token a slot) at each slot count R;
5. engine@R: the speculative engine's round at each verification bucket and its draft alone.

Every program is timed best of `repeats` after a call that compiles it, beside its roofline
(bench/roofline_model.py: max(bytes it must read / bandwidth, FLOPs / matmul rate)); each
compiled program's `memory_analysis()` and the seconds its `lower().compile()` took are kept, and
each stage's compile seconds as JAX reports them (tracing, lowering, compiling: the prefills that
fill the caches included). Programs are compiled for the engine's state shapes and each round is
timed from a fresh prefilled state it donates (`round_timing`), so a stage holds one decode state
at a time; between stages the engines are dropped (`del`, then a garbage collection), so one
stage's buffers are gone before the next allocates, and the bytes of the arrays still alive are
recorded. The random models live for the whole run, their weights held once (an engine leaves its
model holding the per-layer split it reads, which the next engine takes as it is).

The budget is checked before every stage and every timed program: once it is spent the rest is
skipped with a line saying so (a stage already running is not interrupted). A stage that raises
(a program that does not fit the device's memory, a kernel that does not lower) is reported as
failed with its error and the run goes on.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import importlib.metadata
import json
import logging
import os
import platform as host_platform
import time
from pathlib import Path

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

from dspark_jax.bench import roofline_model as rm
from dspark_jax.bench.roofline_measure import best_of, device_rates, live_bytes, random_models, repeated, round_timing
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine.config import EngineConfig
from dspark_jax.engine.engine import Engine
from dspark_jax.engine.timing import engine_draft_timer
from dspark_jax.io.compile_cache import compile_cache_dir, compile_seconds
from dspark_jax.scheduler.costs import bucket_plan
from dspark_jax.target.gpu_kernel import choose_gpu_kernel, gpu_kernel_fits
from dspark_jax.target.paged_kernel import attention_lse, dense_attention_lse

__all__ = ["Settings", "Budget", "run", "environment", "package_versions", "kernel_against_reference",
           "gpu_kernel_call", "reference_call", "KERNEL_TOLERANCE", "format_programs", "format_compiled",
           "format_stages"]

log = logging.getLogger(__name__)

MIB, GIB = 2 ** 20, 2 ** 30
# |kernel - reference| allowed per dtype of the cache: both accumulate in float32; the kernel's
# products may run in TF32 on a GPU (float32) and its probabilities are cast to the values' dtype
KERNEL_TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}
_PLUGINS = ("jax-cuda", "jax-rocm", "libtpu", "jax-tpu")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What `run` measures: `preset` (None: the tiny test shapes), the slot counts, the cache length,
    the verification buckets (None: the engine's own for each slot count), dtype, drafter block,
    the share of a slot's room the caches are filled to, timed calls per program, the rates' copy
    size and matmul size (None: sized for the backend) and the time budget in seconds."""

    preset: str | None
    slots: tuple[int, ...] = (1, 64)
    context: int = 2048
    buckets: tuple[int, ...] | None = None
    dtype: str = "bfloat16"
    gamma: int | None = None
    fill: float = 1.0
    repeats: int = 5
    copy_mib: int | None = None
    matmul_n: int | None = None
    budget_s: float = 480.0  # 8 minutes on one GPU


class Budget:
    """Seconds since the run began against its budget."""

    def __init__(self, seconds: float, clock=time.perf_counter):
        self.seconds, self.clock, self.t0 = float(seconds), clock, clock()

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def spent(self) -> bool:
        return self.elapsed() >= self.seconds


# ---------------------------------------------------------------------------- environment


def package_versions() -> dict:
    """{distribution: version} of jax, jaxlib, flax and every installed backend plugin (jax-cuda*,
    jax-rocm*, libtpu*)."""
    out = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name in ("jax", "jaxlib", "flax") or name.startswith(_PLUGINS):
            out[name] = dist.version
    return dict(sorted(out.items()))


def environment() -> dict:
    """The backend this process runs on and what it is built from."""

    devs = jax.devices()
    dev = devs[0]
    try:
        platform_version = jax.extend.backend.get_backend().platform_version
    except Exception as e:  # a plugin without one
        platform_version = f"unknown ({type(e).__name__})"
    stats = _memory_stats(dev)
    versions = package_versions()
    return {"backend": jax.default_backend(), "device_kind": dev.device_kind, "device_count": len(devs),
            "platform_version": " ".join(str(platform_version).split()), "jax": jax.__version__,
            "jaxlib": versions.get("jaxlib", "?"), "packages": versions,
            "plugins": {k: v for k, v in versions.items() if k.startswith(_PLUGINS)},
            "python": host_platform.python_version(),
            "memory_limit": None if stats is None else stats.get("bytes_limit"),
            "mem_fraction": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
            "compile_cache": None if compile_cache_dir() is None else str(compile_cache_dir())}


def _memory_stats(dev) -> dict | None:
    try:
        return dev.memory_stats()
    except Exception:  # a backend that does not report it
        return None


# ---------------------------------------------------------------------------- compiled programs


def compiled(jitted, *args) -> dict:
    """Lower and compile `jitted` for `args` (what its first call with them would run, cached for
    that call): the seconds it took and the executable's `memory_analysis()` in bytes."""
    t0 = time.perf_counter()
    exe = jitted.lower(*args).compile()
    seconds = time.perf_counter() - t0
    m = exe.memory_analysis()
    mem = {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
           "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}
    mem["total"] = mem["arguments"] + mem["outputs"] + mem["temporaries"] - mem["aliased"]
    return {"compile_s": seconds, "memory": mem}


def _row(program: str, slots: int, bucket, fp: rm.Footprint, timing: dict, rates: dict | None) -> dict:
    row = {"program": program, "slots": slots, "bucket": bucket, "tokens": fp.tokens, "ms": 1e3 * timing["best_s"],
           "median_ms": 1e3 * timing["median_s"], "repeats": timing["repeats"], "bytes": fp.bytes, "flops": fp.flops,
           "bytes_by_part": dict(fp.parts)}
    return _with_roofline(row, rates)


def _with_roofline(row: dict, rates: dict | None) -> dict:
    if rates is None:  # the rates were not measured (budget, failure): no ratio
        return {**row, "roofline_ms": None, "bound": None, "ratio": None}
    roof, bound = rm.roofline(row["bytes"], row["flops"], rates["bandwidth"], rates["flop_rate"])
    return {**row, "roofline_ms": 1e3 * roof, "bound": bound, "ratio": row["ms"] / (1e3 * roof)}


# ---------------------------------------------------------------------------- the kernel


def gpu_kernel_call(q, k, v, kv_len, interpret: bool = False):
    """The GPU kernel as the engine's attention backend calls it on a dense cache
    (`dense_attention_lse(..., gpu=True)`): q [R, T, Nq, D] over layer 0 of k, v [1, R, Nkv, S, D],
    the queries after each row's kv_len [R] keys (q_start = kv_len: each sees every key)."""

    return dense_attention_lse(q, k, v, kv_len, kv_len, layer=0, gpu=True, interpret=interpret)


def reference_call(q, k, v, kv_len):
    """The reference path over the same cache: each row's whole cache gathered `[S, Nkv, D]` and
    masked to its kv_len keys, one softmax (`attention_lse`)."""

    R, T, S = q.shape[0], q.shape[1], k.shape[3]
    mask = jnp.broadcast_to(jnp.arange(S)[None, None, :] < kv_len[:, None, None], (R, T, S))
    return attention_lse(q, k[0].swapaxes(1, 2), v[0].swapaxes(1, 2), mask)


def kernel_against_reference(cfg, dtype, *, slots: int, context: int, tokens: int, fill: int, repeats: int,
                             gpu: bool, interpret: bool = False, seed: int = 0) -> dict:
    """One layer's cache attention for `slots` rows of `tokens` queries each, every row's cache
    (`context` positions) filled to `fill` keys, read by the GPU kernel (`gpu`; `interpret`: in
    Pallas interpret mode, as off a GPU) and by the reference (the row's whole cache gathered,
    masked): both compiled and timed, their outputs (normalised output and log-sum-exp) compared.
    -> {"shape", "reference", "kernel" (None off GPU or where the kernel does not take the shape),
    "kernel_name" (target/gpu_kernel.py's choice: "mosaic" or "triton"), "max_diff", "tolerance",
    "equal", "bytes", "flops"}."""

    R, T, S = slots, tokens, context
    nq, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (R, T, nq, d), dtype)
    k = jax.random.normal(keys[1], (1, R, nkv, S, d), dtype)  # one layer, heads-major as target/kv_cache.py
    v = jax.random.normal(keys[2], (1, R, nkv, S, d), dtype)
    kv_len = jnp.full((R,), fill, jnp.int32)

    item = jnp.dtype(dtype).itemsize
    out = {"shape": {"slots": R, "queries": T, "heads": nq, "kv_heads": nkv, "head_dim": d, "context": S,
                     "keys": fill, "dtype": jnp.dtype(dtype).name},
           "bytes": float(2 * R * fill * nkv * d * item + R * T * nq * d * item),
           "flops": float(4 * R * T * nq * d * fill), "kernel": None, "max_diff": None, "equal": None,
           "tolerance": KERNEL_TOLERANCE.get(jnp.dtype(dtype).name, 2e-3)}
    args = (q, k, v, kv_len)
    ref = jax.jit(reference_call)
    out["reference"] = {**compiled(ref, *args), **best_of(lambda _: ref(*args), repeats)}
    if not gpu:
        out["kernel_note"] = "no GPU: skipped"
        return out
    if not gpu_kernel_fits(d, S, dense=True):
        out["kernel_note"] = f"the GPU kernel does not take head dim {d} / cache length {S}: skipped"
        return out
    out["kernel_name"] = choose_gpu_kernel(dtype, d, S, dense=True, interpret=interpret)  # as the call chooses
    ker = jax.jit(functools.partial(gpu_kernel_call, interpret=interpret))
    out["kernel"] = {**compiled(ker, *args), **best_of(lambda _: ker(*args), repeats)}
    got, want = jax.device_get(ker(*args)), jax.device_get(ref(*args))
    diff = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
               for a, b in zip(got, want))
    out["max_diff"], out["equal"] = diff, bool(diff <= out["tolerance"])
    return out


# ---------------------------------------------------------------------------- the run


class _Run:
    """One run's document, its stages and the text it emits."""

    def __init__(self, settings: Settings, command: str, json_path, emit):
        self.s, self.emit, self.json_path = settings, emit, None if json_path is None else Path(json_path)
        self.budget = Budget(settings.budget_s)
        self.doc = {"command": command, "settings": dataclasses.asdict(settings), "environment": None,
                    "rates": None, "kernel": [], "programs": [], "compiled": [], "stages": [], "skipped": [],
                    "budget_s": settings.budget_s}
        self.models = None
        self.programs_header = False

    def save(self) -> None:
        self.doc["elapsed_s"] = self.budget.elapsed()
        if self.json_path is not None:
            self.json_path.write_text(json.dumps(self.doc, indent=1, default=float))

    def skip(self, what: str) -> bool:
        """True (and a line, the skipped item recorded) once the budget is spent."""
        if not self.budget.spent():
            return False
        self.emit(f"budget: {self.s.budget_s:g} s spent ({self.budget.elapsed():.1f} s elapsed): skipped {what}")
        self.doc["skipped"].append(what)
        return True

    def stage(self, name: str, fn, always: bool = False) -> None:
        if not always and self.skip(f"stage {name}"):
            self.doc["stages"].append({"stage": name, "status": "skipped"})
            self.save()
            return
        log.info("%s (%.1f s elapsed of %g)", name, self.budget.elapsed(), self.s.budget_s)
        c0, t0 = compile_seconds(), time.perf_counter()
        entry = {"stage": name, "status": "done"}
        try:
            fn()
        except Exception as e:  # reported, and the next stage runs
            log.debug("stage %s failed", name, exc_info=True)
            msg = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            entry.update(status="failed", error=msg[:400])
            self.emit(f"FAILED {name}: {msg[:400]}")
        live = live_bytes()  # after a garbage collection: the stage's engines and states are gone
        stats = _memory_stats(jax.devices()[0])
        entry.update(seconds=time.perf_counter() - t0, compile_s=compile_seconds() - c0, live_bytes=live,
                     device_memory=None if stats is None else {k: stats[k] for k in
                                                               ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
                                                               if k in stats})
        self.doc["stages"].append(entry)
        self.save()

    # -- stages

    def environment(self) -> None:
        env = self.doc["environment"] = environment()
        plugins = ", ".join(f"{k} {v}" for k, v in env["plugins"].items()) or "none"
        limit = "not reported" if env["memory_limit"] is None else f"{env['memory_limit'] / GIB:.1f} GiB"
        cache = ("off: every program is compiled in this run" if env["compile_cache"] is None else
                 f"{env['compile_cache']} (programs read back from it count as compile seconds; "
                 "--no-compile-cache for cold compiles)")
        self.emit("== environment\n"
                  f"backend        {env['backend']}: {env['device_count']} x {env['device_kind']} (platform "
                  f"{env['platform_version']})\n"
                  f"versions       jax {env['jax']}, jaxlib {env['jaxlib']}, flax {env['packages'].get('flax', '?')}, "
                  f"plugins: {plugins}; Python {env['python']}\n"
                  f"device memory  limit {limit} (XLA_PYTHON_CLIENT_MEM_FRACTION={env['mem_fraction']})\n"
                  f"compile cache  {cache}\n"
                  f"budget         {self.s.budget_s:g} s")

    def load_models(self) -> None:
        dtype = jnp.dtype(self.s.dtype)
        t0 = time.perf_counter()
        target, drafter, name = random_models(self.s.preset, dtype, self.s.gamma)
        jax.block_until_ready(jax.tree.leaves((target, drafter)))
        self.models = (target, drafter, name)
        cfg = target.cfg
        n_t = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(target))
        count = f"{n_t / 1e9:.3g} B" if n_t >= 1e9 else f"{n_t / 1e6:.3g} M"
        self.doc["model"] = {"name": name, "dtype": self.s.dtype, "target_params": n_t,
                             "layers": cfg.num_layers, "hidden": cfg.hidden_size, "build_s": time.perf_counter() - t0}
        self.emit(f"model          {name}: random weights, {self.s.dtype}, target {count} parameters "
                  f"({cfg.num_layers} layers x {cfg.hidden_size}), built in {time.perf_counter() - t0:.1f} s")

    def rates(self) -> None:
        accel = jax.default_backend() != "cpu"
        copy_mib = self.s.copy_mib or (1024 if accel else 256)
        n = self.s.matmul_n or (8192 if accel else 1024)
        r = self.doc["rates"] = device_rates(jnp.dtype(self.s.dtype), copy_mib, n, self.s.repeats)
        unit, scale = ("TFLOP/s", 1e12) if r["flop_rate"] >= 1e12 else ("GFLOP/s", 1e9)
        self.emit("\n== device rates (measured in this run; every roofline below uses them)\n"
                  f"copy           {copy_mib} MiB: {r['copy_rate'] / 1e9:.1f} GB/s copied = "
                  f"{r['copy_traffic'] / 1e9:.1f} GB/s read + written; read stream {r['read_rate'] / 1e9:.1f} GB/s; "
                  f"bandwidth used {r['bandwidth'] / 1e9:.1f} GB/s\n"
                  f"matmul         {r['matmul_dtype']} [{n}, {n}] x [{n}, {n}]: {r['flop_rate'] / scale:.3g} {unit}")

    def kernel(self) -> None:
        target = self.models[0]
        gpu = jax.default_backend() == "gpu"
        G = self._gamma()
        self.emit("\n== cache attention: the GPU kernel against the reference (one layer over the filled cache's keys; "
                  "q rows: query tokens x query heads)")
        if not gpu:
            self.emit("no GPU: the GPU kernel skipped; the reference timed alone")
        self.emit(_KERNEL_HEAD)
        for R in self.s.slots:
            if self.skip(f"kernel@{R}"):
                continue
            fill = self._fill(G)
            k = kernel_against_reference(target.cfg, jnp.dtype(self.s.dtype), slots=R, context=self.s.context,
                                         tokens=G + 1, fill=fill, repeats=self.s.repeats, gpu=gpu)
            rates = self.doc["rates"]
            for part in ("reference", "kernel"):
                if k[part] is not None:
                    k[part] = _with_roofline({"ms": 1e3 * k[part]["best_s"], "bytes": k["bytes"], "flops": k["flops"],
                                              **k[part]}, rates)
                    self._compiled(f"attention_{part}", R, {"compile_s": k[part]["compile_s"],
                                                            "memory": k[part]["memory"]})
            self.doc["kernel"].append(k)
            self.emit(_kernel_line(k))
            self.save()

    def target_step(self, R: int) -> None:
        target = self.models[0]
        fill = self._fill(self._gamma())
        sp = SamplingParams(0.0, 0, 1.0)
        eng = Engine(target, None, EngineConfig(num_slots=R, max_len=self.s.context, buckets=(R,)))
        st, ctl = eng.state_shape, eng.control(sp, gamma=0, pin=0, table=eng.unpriced_table)  # no state made
        self._compiled("target_step", R, compiled(eng._round, eng.tp, eng.dp, st, ctl))
        m = rm.model_shapes(eng.spec, eng.tp, {}, st)
        del st, ctl
        if self.skip(f"target_step@{R} timing"):
            return
        timing = round_timing(eng, sp, R, (R, 0), self.s.repeats, prompt=min(fill, 16), fill=fill)
        self._add(_row("target_step", R, R, rm.target_step(m, R, fill), timing, self.doc["rates"]))
        del eng

    def engine(self, R: int) -> None:

        target, drafter, _ = self.models
        G = self._gamma()
        fill = self._fill(G)
        sp = SamplingParams(0.0, 0, 1.0)
        eng = Engine(target, drafter, EngineConfig(num_slots=R, max_len=self.s.context, policy="fixed",
                                                   buckets=self._buckets(R, G)))
        prompt = max(min(16, fill), eng.min_prompt_len, 2)
        st = eng.state_shape  # compiled for its shapes, no state made
        ctl = eng.control(sp, gamma=G, pin=G, table=eng.unpriced_table)  # the timed rounds' signature
        m = rm.model_shapes(eng.spec, eng.tp, rm.named_leaves(eng.dp), st)
        self._compiled("round", R, compiled(eng._round, eng.tp, eng.dp, st, ctl))
        for b, (k, g) in sorted(bucket_plan(eng.priced_buckets, eng.R, eng.G).items()):
            if self.skip(f"round@{R} bucket {b}"):
                continue
            timing = round_timing(eng, sp, b, (k, g), self.s.repeats, prompt=prompt, fill=fill)
            self._add(_row("round", R, b, rm.round_footprint(m, k, g, fill, f"round@{b}"), timing,
                           self.doc["rates"]))
        if not self.skip(f"draft@{R}"):
            self._compiled("draft", R, compiled(eng._draft, eng.dp, st, ctl.sampling))
            timing = repeated(engine_draft_timer(eng, sp, prompt=prompt, fill=fill), self.s.repeats)
            self._add(_row("draft", R, None, rm.draft_footprint(m, R, fill), timing, self.doc["rates"]))
        del eng, st, ctl

    # -- helpers

    def _gamma(self) -> int:
        return int(self.models[1].gamma)  # the drafter's block (--gamma, else the preset's)

    def _fill(self, G: int) -> int:
        room = self.s.context - G - 2  # what a round leaves of a slot's cache
        if room < 1:
            raise ValueError(f"context {self.s.context} leaves no room for a round of gamma {G}")
        return max(int(self.s.fill * room), 1)

    def _buckets(self, R: int, G: int):
        """--buckets for R slots: those a round of R slots can fill, and the full one R * (G + 1)."""
        if self.s.buckets is None:
            return None
        full = R * (G + 1)
        return tuple(sorted({b for b in self.s.buckets if b <= full} | {full}))

    def _compiled(self, program: str, slots: int, comp: dict) -> None:
        self.doc["compiled"].append({"program": program, "slots": slots, **comp})
        self.save()

    def _add(self, row: dict) -> None:
        if not self.programs_header:
            self.emit("\n== decode programs against the roofline (best of the timed calls; roofline = max(bytes / "
                      "bandwidth, FLOPs / matmul rate))\n" + format_programs([]))
            self.programs_header = True
        self.doc["programs"].append(row)
        self.emit(format_programs([row], header=False))
        self.save()


_KERNEL_HEAD = (f"{'slots':>5}{'q rows':>8}{'keys':>7}{'reference ms':>14}{'x roofline':>11}{'kernel ms':>11}"
                f"{'x roofline':>11}{'max |diff|':>12}  equal")


def _kernel_line(k: dict) -> str:
    sh, ref, ker = k["shape"], k["reference"], k["kernel"]
    x = lambda r: "-" if r is None or r.get("ratio") is None else f"{r['ratio']:.3g}"  # noqa: E731
    line = f"{sh['slots']:>5}{sh['queries'] * sh['heads']:>8}{sh['keys']:>7}{ref['ms']:>14.4g}{x(ref):>11}"
    if ker is None:
        return line + f"{'-':>11}{'-':>11}{'-':>12}  {k['kernel_note']}"
    return (line + f"{ker['ms']:>11.4g}{x(ker):>11}{k['max_diff']:>12.3g}  "
            f"{'yes' if k['equal'] else 'NO'} ({k['kernel_name']} kernel; tolerance {k['tolerance']:g})")


def format_programs(rows: list[dict], header: bool = True) -> str:
    """The decode programs' table: time, bytes, FLOPs, roofline and their ratio."""
    head = (f"{'program':<12}{'slots':>6}{'bucket':>7}{'tokens':>7}{'best ms':>10}{'median ms':>11}{'MB read':>11}"
            f"{'GFLOP':>10}{'roofline ms':>13}  {'bound':<8}{'ratio':>8}")
    lines = [head, "-" * len(head)] if header else []
    for r in rows:
        roof = "-" if r["roofline_ms"] is None else f"{r['roofline_ms']:.4g}"
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3g}"
        bucket = "-" if r["bucket"] is None else str(r["bucket"])
        lines.append(f"{r['program']:<12}{r['slots']:>6}{bucket:>7}{r['tokens']:>7}{r['ms']:>10.4g}"
                     f"{r['median_ms']:>11.4g}{r['bytes'] / 1e6:>11.5g}{r['flops'] / 1e9:>10.4g}{roof:>13}  "
                     f"{r['bound'] or '-':<8}{ratio:>8}")
    return "\n".join(lines)


def format_compiled(entries: list[dict]) -> str:
    """Each compiled program's `memory_analysis()` (MiB) and its compile seconds."""
    mib = lambda b: f"{b / MIB:>13.2f}"  # noqa: E731
    lines = [f"{'program':<20}{'slots':>6}{'arguments':>13}{'outputs':>13}{'temporaries':>13}{'aliased':>13}"
             f"{'total':>13}{'compile s':>11}   (MiB)"]
    for e in entries:
        m = e["memory"]
        lines.append(f"{e['program']:<20}{e['slots']:>6}{mib(m['arguments'])}{mib(m['outputs'])}"
                     f"{mib(m['temporaries'])}{mib(m['aliased'])}{mib(m['total'])}{e['compile_s']:>11.2f}")
    return "\n".join(lines)


def format_stages(stages: list[dict]) -> str:
    """Each stage's seconds, the part JAX spent compiling, the bytes of the arrays alive after it,
    the device memory in use after it and the most in use so far (where the backend reports them),
    and how it ended."""
    lines = [f"{'stage':<16}{'seconds':>9}{'compile s':>11}{'arrays GiB':>12}{'in use GiB':>12}{'peak GiB':>10}"
             "  status   (arrays: alive after the stage; in use / peak: the device's, peak the most so far)"]
    for s in stages:
        dm = s.get("device_memory") or {}
        gib = lambda k: f"{dm[k] / GIB:.2f}" if k in dm else "-"  # noqa: E731
        sec = lambda k: f"{s[k]:.1f}" if k in s else "-"  # noqa: E731
        status = s["status"] + (f": {s['error']}" if "error" in s else "")
        arrays = f"{s['live_bytes'] / GIB:.4g}" if "live_bytes" in s else "-"
        lines.append(f"{s['stage']:<16}{sec('seconds'):>9}{sec('compile_s'):>11}{arrays:>12}{gib('bytes_in_use'):>12}"
                     f"{gib('peak_bytes_in_use'):>10}  {status}")
    return "\n".join(lines)


def run(settings: Settings, *, command: str = "", json_path=None, emit=print) -> dict:
    """Every stage of the first-contact benchmark under `settings` (module docstring): each
    stage's text to `emit` as it ends, the document to `json_path` after every stage. -> the
    document ("stages": each one's status: done, failed with its error, or skipped)."""
    r = _Run(settings, command, json_path, emit)
    compile_seconds()  # JAX's compile events counted from here
    r.stage("environment", r.environment, always=True)
    r.stage("models", r.load_models)
    r.stage("rates", r.rates)
    stages = [("kernel", r.kernel)] + [(f"target_step@{R}", lambda R=R: r.target_step(R)) for R in settings.slots]
    stages += [(f"engine@{R}", lambda R=R: r.engine(R)) for R in settings.slots]
    for name, fn in stages:
        if r.models is None and not r.budget.spent():  # the models failed to build: nothing to run
            r.emit(f"skipped {name}: no models")
            r.doc["stages"].append({"stage": name, "status": "skipped", "error": "no models"})
            continue
        r.stage(name, fn)
    r.models = None
    gc.collect()
    r.emit("\n== compiled programs: memory_analysis() and compile seconds (lower + compile)\n"
           + format_compiled(r.doc["compiled"]))
    r.emit("\n== stages (compile s: JAX's tracing, lowering and compiling in the stage; device memory after it)\n"
           + format_stages(r.doc["stages"]))
    r.emit(f"\ntotal {r.budget.elapsed():.1f} s of a {settings.budget_s:g} s budget; "
           f"{sum(s['status'] == 'failed' for s in r.doc['stages'])} stage(s) failed, "
           f"{len(r.doc['skipped'])} item(s) skipped for the budget")
    r.save()
    return r.doc

