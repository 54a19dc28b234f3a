"""`python -m dspark_jax.engine.plan`: per-chip serving memory of the engine for a target preset,
R slots x a context, on a (data, fsdp, tensor) mesh, from shapes and from the compiled round.

    python -m dspark_jax.engine.plan configs/qwen3_8b_dspark.yaml --slots 128 --context 8192 --mesh 1,1,8 --hbm-gib 16

Weights and caches are exact (their shapes and the rules table's shardings); with `--compile`
the engine's round (draft, verification over the largest bucket, rejection, cache update) is
lowered for those shardings on fake CPU devices and compiled, and XLA's `memory_analysis()` gives
one chip's arguments, outputs and temporaries. Dense caches hold `[L, R, context, kv_heads,
head_dim]` whatever the slots use; with `--kv-pages NUM,SIZE` target and drafter caches are pools
of NUM pages of SIZE tokens (the engine's `kv_pages`), sized for the tokens the slots hold at
once, e.g. 128 slots averaging 2048 tokens: `--kv-pages 16384,16`.
"""

from __future__ import annotations

import argparse
import sys
from dspark_jax.cli import add_kv_pages_argument, add_prefill_chunk_argument, prefill_chunk, report_user_errors

GIB = 1024 ** 3


def _chip_bytes(x, sharding) -> int:
    import numpy as np

    return int(np.prod(sharding.shard_shape(x.shape))) * np.dtype(x.dtype).itemsize


def plan(cfg, slots: int, context: int, mesh_shape: tuple[int, int, int], gamma: int | None = None,
         compile_round: bool = False, kv_pages: tuple[int, int] | None = None,
         prefill_chunk: int | None = None) -> dict:
    """Per-chip bytes: target / drafter weights, target / drafter KV, and (compile_round) XLA's
    arguments / outputs / temporaries of one round."""
    import jax
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dspark_jax.drafter.frozen import Frozen
    from dspark_jax.engine import Engine
    from dspark_jax.engine.engine import decode_shardings
    from dspark_jax.engine.round import round_step
    from dspark_jax.engine.verify import target_arrays
    from dspark_jax.parallel.sharding import make_mesh, state_shardings
    from dspark_jax.scheduler import prefix as scheduler
    from dspark_jax.train.plan import abstract_models

    d, f, t = mesh_shape
    n = d * f * t
    if jax.device_count() < n:
        raise RuntimeError(f"mesh {d}x{f}x{t} needs {n} devices, {jax.device_count()} exist: start with "
                           f"jax_num_cpu_devices={n} (the command does)")
    mesh = make_mesh(d, f, t, devices=jax.devices()[:n])
    target, drafter = abstract_models(cfg)
    tg, tstate = nnx.split(target)
    dg, dparams, dfrozen = nnx.split(drafter, nnx.Param, Frozen)
    box = {}

    def build(ts, dp, dfz):  # the Engine's static parts, built on abstract models (nothing allocated)
        eng = Engine(nnx.merge(tg, ts), nnx.merge(dg, dp, dfz), num_slots=slots, max_len=context, gamma=gamma,
                     kv_pages=kv_pages, prefill_chunk=prefill_chunk)
        box["eng"] = eng
        return 0

    jax.eval_shape(build, tstate, dparams, dfrozen)
    eng = box["eng"]
    st = jax.eval_shape(eng._fresh_state)
    st_sh = decode_shardings(st, mesh)
    t_sh, dp_sh, dfz_sh = (state_shardings(x, mesh) for x in (tstate, dparams, dfrozen))
    leaves = lambda tree, sh: sum(_chip_bytes(x, s) for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(sh)))
    out = {"target_weights": leaves(tstate, t_sh), "drafter_weights": leaves(dparams, dp_sh),
           "target_kv": leaves((st.cache.k, st.cache.v), (st_sh.cache.k, st_sh.cache.v)),
           "drafter_kv": leaves((st.dcache.k, st.dcache.v), (st_sh.dcache.k, st_sh.dcache.v)),
           "G": eng.G, "buckets": list(eng.buckets), "kv_pages": kv_pages,
           "prefill_chunk": prefill_chunk}
    if compile_round:
        spec = eng.spec

        def one_round(ts, dp, dfz, s, ctl):
            return round_step(spec, target_arrays(nnx.merge(tg, ts)), nnx.merge(dg, dp, dfz).arrays(), s, ctl)

        with jax.set_mesh(mesh):
            ctl = eng.control(table=scheduler.make_table(eng.priced_buckets, t_verify=[1.0] * len(eng.priced_buckets)))
            rep = NamedSharding(mesh, P())
            fn = jax.jit(one_round, in_shardings=(t_sh, dp_sh, dfz_sh, st_sh, jax.tree.map(lambda _: rep, ctl)),
                         out_shardings=(st_sh, None), donate_argnums=(3,))
            m = fn.lower(tstate, dparams, dfrozen, st, ctl).compile().memory_analysis()
        out.update(arguments=int(m.argument_size_in_bytes), outputs=int(m.output_size_in_bytes),
                   temporaries=int(m.temp_size_in_bytes), aliased=int(m.alias_size_in_bytes))
    return out


def format_plan(name: str, slots: int, context: int, mesh_shape, res: dict, hbm_gib: float | None) -> str:
    g = lambda b: f"{b / GIB:9.2f} GiB"
    pages = res.get("kv_pages")
    kind = "(dense)" if pages is None else "(paged)"
    # tokens the caches hold: every slot's context (dense, split over data) or the pool (whole on data)
    tokens, per_token_div = (slots * context, mesh_shape[0]) if pages is None else (pages[0] * pages[1], 1)
    lines = [f"{name}: {slots} slots x {context} tokens, mesh data {mesh_shape[0]} x fsdp {mesh_shape[1]} x "
             f"tensor {mesh_shape[2]}, gamma {res['G']}, per chip:",
             f"  target weights      {g(res['target_weights'])}",
             f"  drafter weights     {g(res['drafter_weights'])}",
             f"  target KV {kind:9s} {g(res['target_kv'])}   ({res['target_kv'] / tokens * per_token_div:.0f} B "
             "per token per chip)",
             f"  drafter KV {kind:8s} {g(res['drafter_kv'])}"]
    if pages is not None:
        lines.append(f"  KV pool: {pages[0]} pages of {pages[1]} tokens = {pages[0] * pages[1]} tokens in use at once "
                     f"({pages[0] * pages[1] / slots:.0f} per slot on average; a slot holds at most {context})")
    total = res["target_weights"] + res["drafter_weights"] + res["target_kv"] + res["drafter_kv"]
    lines.append(f"  state total         {g(total)}")
    if "temporaries" in res:
        peak = res["arguments"] + res["outputs"] - res["aliased"] + res["temporaries"]
        lines += [f"  compiled round: arguments {g(res['arguments']).strip()}, outputs {g(res['outputs']).strip()} "
                  f"(aliased {g(res['aliased']).strip()}), temporaries {g(res['temporaries']).strip()}",
                  f"  compiled peak       {g(peak)}"]
        total = max(total, peak)
    if hbm_gib:
        margin = hbm_gib * GIB - total
        lines.append(f"  HBM {hbm_gib:g} GiB: {'fits' if margin >= 0 else 'does NOT fit'}, margin {margin / GIB:.2f} GiB")
    return "\n".join(lines)


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax.engine.plan", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("config", help="a preset naming target.model (and the drafter), e.g. configs/qwen3_8b_dspark.yaml")
    ap.add_argument("--slots", type=int, default=128)
    ap.add_argument("--context", type=int, default=8192, help="tokens per slot (prompt + completion)")
    ap.add_argument("--mesh", default="1,1,8", metavar="DATA,FSDP,TENSOR")
    ap.add_argument("--gamma", type=int, default=None, help="verification length (default: the drafter's block)")
    ap.add_argument("--hbm-gib", type=float, default=None, help="HBM per chip, for the fit line (v5e 16, v6e 32, v5p 95)")
    ap.add_argument("--compile", action="store_true", help="also compile one round and report XLA's per-chip memory")
    add_kv_pages_argument(ap)
    add_prefill_chunk_argument(ap, None)
    args = ap.parse_args(argv)
    try:
        mesh_shape = tuple(int(x) for x in args.mesh.split(","))
        assert len(mesh_shape) == 3
    except (ValueError, AssertionError):
        print(f"error: --mesh {args.mesh!r}: give DATA,FSDP,TENSOR, e.g. 1,1,8", file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_num_cpu_devices", mesh_shape[0] * mesh_shape[1] * mesh_shape[2])
    jax.config.update("jax_platforms", "cpu")
    from dspark_jax.config import ConfigError, from_cli

    try:
        cfg = from_cli([args.config])
        if cfg.target.model is None:
            raise ConfigError(f"{args.config} names no target.model: use a preset such as configs/qwen3_8b_dspark.yaml")
        res = plan(cfg, args.slots, args.context, mesh_shape, args.gamma, args.compile, args.kv_pages,
                   prefill_chunk(args.prefill_chunk))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_plan(args.config, args.slots, args.context, mesh_shape, res, args.hbm_gib))
    return 0


if __name__ == "__main__":
    sys.exit(main())
