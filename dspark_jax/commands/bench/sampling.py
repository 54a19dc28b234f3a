"""`python -m dspark_jax bench sampling`: the top-p / large top-k cut by bisection against a full
stable sort of the vocabulary (what `sampling_probs` did before), same inputs, alternating, in one run.

    python -m dspark_jax bench sampling --vocab 49152 --rows 1 8 32
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def sorted_probs(logits, temperature, top_k, top_p):
    """The former full-sort path: stable descending argsort, cut in sorted order, scattered back."""
    import jax.numpy as jnp

    from dspark_jax.decoding.sampling import _truncate_sorted

    shape = logits.shape[:-1]
    scaled = logits / temperature
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), shape)
    tp = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), shape)
    k_on = (k > 0) & (k < logits.shape[-1])
    order = jnp.argsort(-scaled, axis=-1, stable=True)
    s_probs = _truncate_sorted(jnp.take_along_axis(scaled, order, axis=-1), k, k_on, tp)
    return jnp.put_along_axis(jnp.zeros_like(s_probs), order, s_probs, axis=-1, inplace=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench sampling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default: SmolLM2's 49152)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32], help="rows sampled together")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off; > 64 takes the bisection path too")
    ap.add_argument("--top-p", type=float, default=0.8)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--repeats", type=int, default=7, help="alternating timed calls per side (median reported)")
    args = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from dspark_jax.decoding.sampling import sampling_probs

    print(f"backend {jax.default_backend()}  V {args.vocab}  "
          f"T {args.temperature} top-k {args.top_k} top-p {args.top_p}")
    print(f"{'rows':>5} {'sort ms':>10} {'bisect ms':>10} {'bisect / sort':>22} {'max |diff|':>11}")
    rng = np.random.default_rng(0)
    for rows in args.rows:
        logits = jnp.asarray(rng.normal(size=(rows, args.vocab)) * 3, jnp.float32)
        fns = {"sort": jax.jit(lambda x: sorted_probs(x, args.temperature, args.top_k, args.top_p)),
               "bisect": jax.jit(lambda x: sampling_probs(x, args.temperature, args.top_k, args.top_p))}
        outs = {n: f(logits).block_until_ready() for n, f in fns.items()}
        diff = float(jnp.max(jnp.abs(outs["sort"] - outs["bisect"])))
        times = {n: [] for n in fns}
        for _ in range(args.repeats):
            for n, f in fns.items():
                t0 = time.perf_counter()
                f(logits).block_until_ready()
                times[n].append(time.perf_counter() - t0)
        ratio = np.asarray(times["bisect"]) / np.asarray(times["sort"])
        med = {n: 1e3 * float(np.median(t)) for n, t in times.items()}
        print(f"{rows:>5} {med['sort']:>10.2f} {med['bisect']:>10.2f} "
              f"{np.median(ratio):>8.3f} [{ratio.min():.3f}, {ratio.max():.3f}] {diff:>11.2e}")
    return 0
