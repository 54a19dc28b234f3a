"""Training-step throughput on the `bench_cpu` shape (or any config).

Prints the median step time, target tokens/s, analytic FLOPs per step and the achieved
FLOP/s as a ratio of this machine's measured float32 matmul rate, all from one run.
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench train", description=__doc__)
    ap.add_argument("config", nargs="?", default="bench_cpu", help="config preset or path (default: bench_cpu)")
    ap.add_argument("overrides", nargs="*", help="section.key=value overrides")
    ap.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up (default 10)")
    args = ap.parse_args(argv)
    import tempfile

    from dspark_jax.config import from_cli
    from dspark_jax.data.pipeline import make_example
    from dspark_jax.train.run import prepare_target
    from dspark_jax.train.trainer import Trainer

    cfg = from_cli([args.config, *args.overrides, f"train.output_dir={tempfile.mkdtemp(prefix='bench_train_')}",
                    "train.checkpoint_every=0"])
    target = prepare_target(cfg)

    class _Synthetic:  # random tokens, everything an assistant span: no dataset needed
        def __init__(self, n, s, v):
            rng = np.random.default_rng(0)
            self.recs = [{"tokens": rng.integers(0, v, s).astype(np.int32),
                          "loss_mask": np.r_[np.zeros(8, bool), np.ones(s - 8, bool)]}
                         for _ in range(n)]

        def __len__(self):
            return len(self.recs)

        def __getitem__(self, i):
            return self.recs[i]

    ds = _Synthetic(max(4, cfg.train.batch_size * 2), cfg.data.seq_len, cfg.target.model.vocab_size - 1)
    tr = Trainer(cfg, target.model, ds, None, progress=False)
    spec = tr.spec
    batch = {k: np.stack([make_example(ds[j], j, spec)[k] for j in range(cfg.train.batch_size)])
             for k in make_example(ds[0], 0, spec)}
    dev = tr._device_batch(batch)
    t0 = time.perf_counter()
    state, m, _ = tr.train_step(tr.state, tr.frozen, tr.t_state, dev)
    jax.block_until_ready(m["loss"])
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        state, m, _ = tr.train_step(state, tr.frozen, tr.t_state, dev)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    tr.close()
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
    return 0
