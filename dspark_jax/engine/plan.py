"""Per-chip serving memory of the engine for a target preset, R slots x a context, on a
(data, fsdp, tensor) mesh: exact weights and caches from the shapes and the rules table's
shardings, and the compiler's figures for the programs the server compiles (the command:
`python -m dspark_jax plan engine`, commands/engine_plan.py)."""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dspark_jax.drafter.abstract import abstract_models
from dspark_jax.drafter.decode_weights import abstract_drafter_arrays
from dspark_jax.drafter.frozen import Frozen
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.layout import decode_shardings
from dspark_jax.engine.round import admit, chosen_rounds, prefill_group, round_choice, round_step
from dspark_jax.names import ENGINE_POLICIES, PLAN_PROGRAMS
from dspark_jax.parallel.sharding import make_mesh, state_shardings
from dspark_jax.parallel.slices import parse_slice
from dspark_jax.parallel.topology import hbm_refusal, slice_devices, slice_mesh
from dspark_jax.scheduler import prefix
from dspark_jax.target.decode_weights import abstract_decode_arrays
from dspark_jax.target.kernels import per_layer_decode

GIB = 1024 ** 3
POLICIES, PROGRAMS = ENGINE_POLICIES, PLAN_PROGRAMS


def _chip_bytes(x, sharding) -> int:

    return int(np.prod(sharding.shard_shape(x.shape))) * x.dtype.itemsize  # typed PRNG keys: their key data's


def peak_bytes(mem: dict) -> int:
    """What a chip holds at once: arguments + outputs not aliased to them + temporaries."""
    return mem["arguments"] + mem["outputs"] - mem["aliased"] + mem["temporaries"]


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    return {"arguments": int(m.argument_size_in_bytes), "outputs": int(m.output_size_in_bytes),
            "temporaries": int(m.temp_size_in_bytes), "aliased": int(m.alias_size_in_bytes)}


def _out_of_memory(err) -> str | None:

    return hbm_refusal(err)


def plan_mesh(mesh_shape: tuple[int, int, int], topology: str | None = None):
    """The mesh the programs compile for: the slice's devices (TPU compiler), else this host's."""


    d, f, t = mesh_shape
    if topology:
        return slice_mesh(topology, d, f, t)
    n = d * f * t
    if jax.device_count() < n:
        raise RuntimeError(f"mesh {d}x{f}x{t} needs {n} devices, {jax.device_count()} exist: start with "
                           f"jax_num_cpu_devices={n} (the command does)")
    return make_mesh(d, f, t, devices=jax.devices()[:n])


class AbstractEngine(NamedTuple):
    """An Engine built on abstract models (nothing allocated) for a mesh, with the shardings of
    its arguments: what the plan and the predicted cost tables compile."""

    eng: Engine
    mesh: object
    tg: object  # target graph
    tstate: object  # abstract target state
    dg: object  # drafter graph
    dparams: object
    dfrozen: object
    state: object  # abstract DecodeState
    state_sh: object
    t_sh: object
    dp_sh: object
    dfz_sh: object
    tp: object  # the target's weights as the programs take them (per layer, `decode_weights`), abstract
    dt: object  # the drafter's arrays as the programs take them (drafter/decode_weights.py), abstract

    @property
    def tp_sh(self):
        """The shardings of `tp`."""
        return jax.tree.map(lambda a: a.sharding, self.tp)

    @property
    def dt_sh(self):
        """The shardings of `dt`."""
        return jax.tree.map(lambda a: a.sharding, self.dt)


def _abstract_drafter(eng: Engine, dg, dparams, dfrozen, dp_sh, dfz_sh, mesh):
    """The drafter's arrays as the engine passes them to its programs (`Engine.dp`), abstract: each
    array's sharding as `Drafter.arrays()` leaves it on the mesh (read from a compile of it), then
    the kind's decode layout (drafter/decode_weights.py)."""
    if not eng.G:
        return {}
    arrays = lambda dp, dfz: nnx.merge(dg, dp, dfz).arrays()
    with jax.set_mesh(mesh):
        shapes = jax.eval_shape(arrays, dparams, dfrozen)
        out_sh = jax.jit(arrays, in_shardings=(dp_sh, dfz_sh)).lower(dparams, dfrozen).compile().output_shardings
    if not eng.kind.decode_layout:
        return jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), shapes, out_sh)
    return abstract_drafter_arrays(shapes, out_sh, mesh, per_layer_decode(mesh), eng.spec.draft.cfg)


def abstract_engine(cfg, mesh, config: EngineConfig, policy: str = "fixed", drafter: bool = True,
                    drafter_in_target_dtype: bool = False) -> AbstractEngine:
    """`policy` "scheduled": the production scheduler with the skip rule (a cost table of the
    engine's buckets); `drafter=False`: the target-only engine; `drafter_in_target_dtype`: the
    drafter's weights cast to the target's dtype, as a trained drafter is loaded to serve."""
    target, dmodel = abstract_models(cfg)
    tg, tstate = nnx.split(target)
    dg, dparams, dfrozen = nnx.split(dmodel, nnx.Param, Frozen)
    if drafter_in_target_dtype and cfg.target.dtype == "bfloat16":
        # the trained weights cast once, and the frozen embedding and LM head as the target holds
        # them (a live drafter shares the target's): priced in float32 they were cast inside every
        # draft program
        dparams, dfrozen = (jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, jnp.bfloat16, sharding=x.sharding)
                                         if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)
                            for tree in (dparams, dfrozen))
    if not drafter:
        dparams, dfrozen = {}, {}
    box = {}

    def build(ts, dp, dfz, table=None):  # the Engine's static parts, built on abstract models (nothing allocated)
        # without a table the fixed-length engine (an "auto" engine would measure its own table)
        kw = dict(policy="production", skip_drafting="known") if table is not None else \
            dict(policy="fixed") if config.policy == "auto" else {}
        d = nnx.merge(dg, dp, dfz) if drafter else None
        box["eng"] = Engine(nnx.merge(tg, ts), d, dataclasses.replace(config, **kw), table=table)
        return 0

    with jax.set_mesh(mesh):  # kernels are chosen for the mesh's platform (parallel/platform.py)
        jax.eval_shape(build, tstate, dparams, dfrozen)
        if policy == "scheduled":  # a cost table of the engine's own buckets (its values do not change shapes)
            b = box["eng"].priced_buckets
            table = prefix.make_table(b, t_verify=[1.0 + i / 8 for i in range(len(b))], t_draft=0.1, as_numpy=True)
            jax.eval_shape(lambda *a: build(*a, table=table), tstate, dparams, dfrozen)
    eng = box["eng"]
    st = jax.eval_shape(eng._fresh_state)
    tp = abstract_decode_arrays(eng.target.cfg, jax.eval_shape(lambda ts: nnx.merge(tg, ts).arrays(), tstate), mesh,
                                per_layer=per_layer_decode(mesh))
    t_sh, dp_sh, dfz_sh = (state_shardings(x, mesh) for x in (tstate, dparams, dfrozen))
    return AbstractEngine(eng=eng, mesh=mesh, tg=tg, tstate=tstate, dg=dg, dparams=dparams, dfrozen=dfrozen,
                          state=st, state_sh=decode_shardings(st, mesh), tp=tp, t_sh=t_sh, dp_sh=dp_sh, dfz_sh=dfz_sh,
                          dt=_abstract_drafter(eng, dg, dparams, dfrozen, dp_sh, dfz_sh, mesh))


def plan(cfg, slots: int, context: int, mesh_shape: tuple[int, int, int], gamma: int | None = None,
         compile_round: bool = False, kv_pages: tuple[int, int] | None = None,
         prefill_chunk: int | None = None, topology: str | None = None, policy: str = "fixed",
         drafter: bool = True, programs=("round",)) -> dict:
    """Per-chip bytes: target weights (once, as the programs read them: the model holds no other
    copy), drafter weights, target / drafter KV, the whole decode state, and (compile_round) XLA's
    arguments / outputs / temporaries of each compiled program in `programs` ("round",
    "prefill", "admit"; the round's also at the top level), with its compile time.
    "host_rounds" (an engine with a skip rule): the programs a host loop runs instead of the
    round (`Engine.step`), reported as "round_choice", "round_plain", "round_settled" and
    "round_drafting"; the round holds all of them and is what the compiled loop runs.
    `policy` "scheduled": the production scheduler with the skip rule (a cost table of the
    engine's buckets); `drafter=False`: the target-only engine."""


    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
    unknown = sorted(set(programs) - set(PROGRAMS))
    if unknown:
        raise ValueError(f"programs {unknown} are not among {PROGRAMS}")
    mesh = plan_mesh(mesh_shape, topology)
    ab = abstract_engine(cfg, mesh, EngineConfig(num_slots=slots, max_len=context, gamma=gamma, kv_pages=kv_pages,
                                                  prefill_chunk=prefill_chunk), policy=policy, drafter=drafter)
    eng, st, st_sh = ab.eng, ab.state, ab.state_sh
    dparams, dp_sh = ab.dparams, ab.dp_sh
    leaves = lambda tree, sh: sum(_chip_bytes(x, s) for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(sh)))
    # the target's weights once: the model and the engine share one set (target/decode_weights.py)
    out = {"target_weights": leaves(ab.tp, ab.tp_sh), "drafter_weights": leaves(dparams, dp_sh),
           "target_kv": leaves((st.cache.k, st.cache.v), (st_sh.cache.k, st_sh.cache.v)),
           "drafter_kv": leaves((st.dcache.k, st.dcache.v), (st_sh.dcache.k, st_sh.dcache.v)) if drafter else 0,
           "decode_state": leaves(st, st_sh),
           "G": eng.G, "buckets": list(eng.buckets), "kv_pages": kv_pages, "prefill_chunk": prefill_chunk,
           "paged_attention": eng.cache_reads, "policy": policy,
           "mode": eng.mode, "topology": topology, "devices": int(mesh.devices.size),
           "platform": mesh.devices.flat[0].platform, "programs": {}}
    if not compile_round:
        return out
    rep = NamedSharding(mesh, P())
    spec = eng.spec

    def one_round(tp, dt, s, ctl):
        return round_step(spec, tp, dt, s, ctl)

    prefill_fn = eng._prefill.__wrapped__

    def join_args(width):
        sds = jax.ShapeDtypeStruct
        keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), slots))
        return (sds((slots, width), jax.numpy.int32, sharding=rep), sds((slots,), jax.numpy.int32, sharding=rep),
                sds((slots,), bool, sharding=rep), sds(keys.shape, keys.dtype, sharding=rep),
                sds((slots,), jax.numpy.int32, sharding=rep))

    ctl = eng.control(table=eng.table)  # concrete arrays: made on the host, outside the slice's mesh
    with jax.set_mesh(mesh):
        ctl_a = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), ctl)
        st_a = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), st, st_sh)
        lowerings = {
            "round": lambda: jax.jit(one_round, in_shardings=(ab.tp_sh, ab.dt_sh, st_sh, None),
                                     out_shardings=(st_sh, None), donate_argnums=(2,)).lower(
                ab.tp, ab.dt, st_a, ctl_a),
            "prefill": lambda: jax.jit(prefill_fn, in_shardings=(ab.tp_sh, ab.dt_sh, st_sh, *([None] * 5)),
                                       out_shardings=st_sh, donate_argnums=(2,)).lower(
                ab.tp, ab.dt, st_a, *join_args(eng.prefill_buckets[-1])),
            "admit": lambda: jax.jit(admit, out_shardings=st_sh, donate_argnums=(0,)).lower(
                st_a, *join_args(context)),
        }
        if "host_rounds" in programs and eng.spec.chooses_rounds:
            host = dict(zip(("round_plain", "round_settled", "round_drafting"), chosen_rounds(spec)))
            if not eng.spec.reads_survivals:
                del host["round_settled"]
            for key, fn in host.items():
                lowerings[key] = (lambda fn: lambda: jax.jit(
                    fn, in_shardings=(ab.tp_sh, ab.dt_sh, st_sh, None), out_shardings=(st_sh, None, None),
                    donate_argnums=(2,)).lower(ab.tp, ab.dt, st_a, ctl_a))(fn)
            lowerings["round_choice"] = lambda: jax.jit(lambda s, c: round_choice(spec, s, c),
                                                        in_shardings=(st_sh, None)).lower(st_a, ctl_a)
        for name in [n for p in programs for n in ([k for k in lowerings if k.startswith("round_")]
                                                     if p == "host_rounds" else [p])]:
            if name == "admit" and not eng.prefill_chunk:
                continue
            t0 = time.perf_counter()
            try:
                compiled = lowerings[name]().compile()
            except Exception as e:  # the compiler's own message, named by program
                oom = _out_of_memory(e)
                if oom is None:
                    raise RuntimeError(f"the engine's {name} program does not compile for {out['platform']} "
                                       f"({topology or 'host devices'}): {e}") from e
                out["programs"][name] = {"out_of_memory": oom, "compile_s": round(time.perf_counter() - t0, 1)}
                continue
            out["programs"][name] = {**_memory(compiled), "compile_s": round(time.perf_counter() - t0, 1),
                                     "kernels": compiled.as_text().count("tpu_custom_call")}
            if name == "prefill":
                p = eng.prefill_buckets[-1]
                out["programs"][name]["prefill_tokens"] = slots * p
                out["programs"][name]["prefill_group"] = prefill_group(slots, p, eng.spec.prefill_tokens)
    if "round" in out["programs"]:
        out.update({k: out["programs"]["round"][k] for k in ("arguments", "outputs", "temporaries", "aliased")})
    return out


def format_plan(name: str, slots: int, context: int, mesh_shape, res: dict, hbm_gib: float | None) -> str:
    g = lambda b: f"{b / GIB:9.2f} GiB"
    pages = res.get("kv_pages")
    kind = "(dense)" if pages is None else "(paged)"
    # tokens the caches hold: every slot's context (dense, split over data) or the pool (whole on data)
    tokens, per_token_div = (slots * context, mesh_shape[0]) if pages is None else (pages[0] * pages[1], 1)
    where = f" on {res['topology']} ({res['devices']} devices, TPU compiler)" if res.get("topology") else ""
    lines = [f"{name}: {slots} slots x {context} tokens, mesh data {mesh_shape[0]} x fsdp {mesh_shape[1]} x "
             f"tensor {mesh_shape[2]}{where}, {res.get('mode', '')} gamma {res['G']}"
             f"{', ' + res['policy'] if res.get('policy', 'fixed') != 'fixed' else ''}, per chip:",
             f"  target weights      {g(res['target_weights'])}",
             f"  drafter weights     {g(res['drafter_weights'])}",
             f"  target KV {kind:9s} {g(res['target_kv'])}   ({res['target_kv'] / tokens * per_token_div:.0f} B "
             "per token per chip)",
             f"  drafter KV {kind:8s} {g(res['drafter_kv'])}"]
    if pages is not None:
        lines.append(f"  KV pool: {pages[0]} pages of {pages[1]} tokens = {pages[0] * pages[1]} tokens in use at once "
                     f"({pages[0] * pages[1] / slots:.0f} per slot on average; a slot holds at most {context}); "
                     f"attention: {res.get('paged_attention')}")
    state = res.get("decode_state", res["target_kv"] + res["drafter_kv"])
    lines.append(f"  decode state        {g(state)}   (the caches and the slots' rows: one state, as a server holds)")
    total = res["target_weights"] + res["drafter_weights"] + state
    lines.append(f"  held                {g(total)}   (weights once + one decode state)")
    for prog, m in res.get("programs", {}).items():
        what = "compiled round" if prog == "round" else f"compiled {prog}"
        if "out_of_memory" in m:
            lines.append(f"  {what}: does NOT fit, the TPU compiler refused it: {m['out_of_memory']}")
            total = float("inf")
            continue
        extra = (f" ({m['prefill_tokens']} tokens, forwarded {m['prefill_group']} rows at a time)"
                 if "prefill_tokens" in m else "")
        lines += [f"  {what}{extra}: arguments {g(m['arguments']).strip()}, outputs {g(m['outputs']).strip()} "
                  f"(aliased {g(m['aliased']).strip()}), temporaries {g(m['temporaries']).strip()}, "
                  f"compiled in {m['compile_s']:.1f} s",
                  f"  {what + ' peak':<19} {g(peak_bytes(m))}"]
        total = max(total, peak_bytes(m))
    if hbm_gib:
        margin = hbm_gib * GIB - total
        lines.append(f"  HBM {hbm_gib:g} GiB: {'fits' if margin >= 0 else 'does NOT fit'}"
                     + (f", margin {margin / GIB:.2f} GiB" if margin != float("-inf") else ""))
    return "\n".join(lines)


def misfits(res: dict, hbm_gib: float | None) -> list[str]:
    """One line per compiled program that does not fit: refused by the TPU compiler, or with a
    peak above `hbm_gib`."""
    fix = "use fewer slots, a shorter context, a KV page pool (--kv-pages), --prefill-chunk or more tensor parallelism"
    out = []
    for prog, m in res.get("programs", {}).items():
        if "out_of_memory" in m:
            out.append(f"the engine's {prog} program does not fit: {m['out_of_memory']}; {fix}")
        elif hbm_gib and peak_bytes(m) > hbm_gib * GIB:
            out.append(f"the engine's {prog} program needs {peak_bytes(m) / GIB:.2f} GiB per chip, more than the "
                       f"{hbm_gib:g} GiB of HBM: {fix}")
    return out


def device_hbm_gib(topology: str) -> float:
    """HBM of one device of the slice (v4 and v7x topologies expose two devices per chip)."""

    slc = parse_slice(topology)
    return slc.hbm_gib * slc.chips / len(slice_devices(slc))
