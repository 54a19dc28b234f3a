"""Training-step throughput on the `bench_cpu` shape (or any config).

Prints the median step time, target tokens/s, analytic FLOPs per step and the achieved
FLOP/s as a ratio of this machine's measured float32 matmul rate, and the step time with the
target's features read from the feature cache (`data.features: cache`) against the online
step, as a ratio: all from one run, on the same batch.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np


def matmul_rate(n: int = 1024, repeats: int = 10) -> float:
    """FLOP/s of a jitted n x n float32 matmul on the default device (best of `repeats`)."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    jax.block_until_ready(f(a))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a))
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def step_flops(cfg) -> dict[str, float]:
    """Analytic FLOPs of one DSpark training step (multiply-add = 2 FLOPs; backward = 2 x forward)."""
    from dspark_jax.drafter import registry

    t = cfg.target.model
    d = registry.resolve(t, cfg.drafter)
    b, s, a, g = cfg.train.batch_size, cfg.data.seq_len, cfg.data.num_anchors, d.gamma
    h, i, v, r = t.hidden_size, t.intermediate_size, t.vocab_size, d.markov_rank
    q, kv = t.num_heads * t.head_dim, t.num_kv_heads * t.head_dim
    layer_proj = h * (q + 2 * kv) + q * h + 3 * h * i  # weights touched per token per layer
    tgt = 2 * b * s * t.num_layers * layer_proj + 4 * b * t.num_layers * s * s * q  # dense + attention
    n = b * a * g  # drafter query tokens
    dr_fwd = (2 * n * d.num_layers * layer_proj
              + 2 * b * s * d.num_layers * h * 2 * kv  # context K/V per drafter layer
              + 4 * b * d.num_layers * a * g * (s + g) * q  # block attention over context + block
              + 2 * b * s * len(d.target_layer_ids) * h * h  # fc fusion
              + 2 * n * h * v  # base logits
              + 2 * n * r * v)  # Markov W2
    target_rows = 2 * n * h * v  # the target distribution rows p_j (no gradient)
    return {"target forward": tgt, "drafter forward": dr_fwd, "drafter backward": 2 * dr_fwd,
            "target LM-head rows": target_rows}


def _step(tr, state, batch):
    """(state, seconds) of one training step, its results on the host."""
    t0 = time.perf_counter()
    state, m, _ = tr.train_step(state, tr.frozen, tr.t_state, batch)
    jax.block_until_ready(m["loss"])
    return state, time.perf_counter() - t0


def time_steps(tr, batches: dict, steps: int):
    """({name: compile + first step seconds}, {name: per-step seconds}) of the named device batches'
    steps, taken in turn (one step of each per round), so a change of the machine's load during the
    run weighs on every variant alike and their ratio stays fair."""
    state, compile_s, times = tr.state, {}, {name: [] for name in batches}
    for name, batch in batches.items():
        state, compile_s[name] = _step(tr, state, batch)
    for _ in range(steps):
        for name, batch in batches.items():
            state, t = _step(tr, state, batch)
            times[name].append(t)
    return compile_s, times


class _Synthetic:
    """Random tokens, everything an assistant span: no dataset needed."""

    def __init__(self, n, s, v):
        rng = np.random.default_rng(0)
        self.recs = [{"tokens": rng.integers(0, v, s).astype(np.int32),
                      "loss_mask": np.r_[np.zeros(8, bool), np.ones(s - 8, bool)]}
                     for _ in range(n)]

    def __len__(self):
        return len(self.recs)

    def __getitem__(self, i):
        return self.recs[i]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench train", description=__doc__)
    ap.add_argument("config", nargs="?", default="bench_cpu", help="config preset or path (default: bench_cpu)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ap.add_argument("--steps", type=int, default=10,
                    help="timed steps after one warm-up, per variant, alternating (default 10)")
    args = ap.parse_args(argv)
    import tempfile
    from pathlib import Path

    from dspark_jax.config import from_cli
    from dspark_jax.data.features import bytes_per_token, ensure_features
    from dspark_jax.data.pipeline import make_example
    from dspark_jax.drafter import registry
    from dspark_jax.train.run import prepare_target
    from dspark_jax.train.trainer import Trainer

    scratch = Path(tempfile.mkdtemp(prefix="bench_train_"))
    cfg = from_cli([args.config, *args.overrides, f"train.output_dir={scratch / 'out'}", "train.checkpoint_every=0"])
    target = prepare_target(cfg)

    ds = _Synthetic(max(4, cfg.train.batch_size * 2), cfg.data.seq_len, cfg.target.model.vocab_size - 1)
    tr = Trainer(cfg, target.model, ds, None, progress=False)
    spec = tr.spec
    cache = None
    if not registry.get_kind(tr.dcfg.kind).needs_target_logits:
        cache = ensure_features(target.model, ds, scratch / "features", layers=tr.dcfg.target_layer_ids,
                                seq_len=spec.seq_len, pad_id=spec.pad_id, progress=False)
    rows = [make_example(ds[j], j, spec, cache) for j in range(cfg.train.batch_size)]
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    variants = {"online": tr._device_batch({k: v for k, v in batch.items() if k not in ("features", "hidden")})}
    if cache is not None:
        variants["cache"] = tr._device_batch(batch)
    compiles, all_times = time_steps(tr, variants, args.steps)
    tr.close()
    compile_s, times = compiles["online"], all_times["online"]
    med = statistics.median(times)
    flops = step_flops(cfg)
    total = sum(flops.values())
    rate = matmul_rate()
    tokens = cfg.train.batch_size * cfg.data.seq_len
    print(f"config: {args.config} {' '.join(args.overrides)}  backend: {jax.default_backend()}  "
          f"devices: {jax.device_count()}")
    print(f"compile + first step: {compile_s:.2f} s")
    print(f"median step time:     {med * 1e3:.1f} ms over {args.steps} steps "
          f"(min {min(times) * 1e3:.1f}, max {max(times) * 1e3:.1f})")
    print(f"target tokens/s:      {tokens / med:,.0f}")
    for k, v in flops.items():
        print(f"  {k:<22} {v / 1e9:9.2f} GFLOP")
    print(f"analytic FLOPs/step:  {total / 1e9:.2f} GFLOP")
    print(f"achieved:             {total / med / 1e9:.2f} GFLOP/s")
    print(f"matmul peak (1024^2 fp32, this machine, this run): {rate / 1e9:.2f} GFLOP/s")
    print(f"ratio achieved / matmul peak: {total / med / rate:.3f}")
    if cache is None:
        print(f"feature cache: not available for {tr.dcfg.kind} (its loss reads the target's logits)")
        return 0
    _print_cache(compiles["cache"], all_times["cache"], times, tokens, args.steps,
                 bytes_per_token(len(tr.dcfg.target_layer_ids), cfg.target.model.hidden_size),
                 flops["target forward"] / total)
    return 0


def _print_cache(compile_c, times_c, times, tokens, steps, per_token, target_share) -> None:
    """The feature-cache variant beside the online step (`times`: the online step's)."""
    med, med_c = statistics.median(times), statistics.median(times_c)
    ratios = [a / b for a, b in zip(times, times_c)]
    print(f"with the feature cache (data.features=cache, {per_token:,} bytes per token on disk):")
    print(f"  compile + first step: {compile_c:.2f} s")
    print(f"  median step time:     {med_c * 1e3:.1f} ms over {steps} steps "
          f"(min {min(times_c) * 1e3:.1f}, max {max(times_c) * 1e3:.1f})")
    print(f"  target tokens/s:      {tokens / med_c:,.0f}")
    print(f"step time online / cache: {med / med_c:.2f}x (median of the per-round ratios "
          f"{statistics.median(ratios):.2f}x, min {min(ratios):.2f}, max {max(ratios):.2f}; the steps alternate)")
    print(f"the target forward's analytic share of the online step's FLOPs: {target_share:.2f}")
