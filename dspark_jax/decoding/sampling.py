"""The one place that turns logits + (temperature, top_k, top_p) into the distribution sampled from.

Both sides of speculative decoding go through :func:`sampling_probs`: the drafter's q_j is
the exact distribution its tokens are sampled from, and the target's p_j receives the same
transform, so rejection sampling (``dspark_jax.decoding.rejection``) stays exact (docs/method.md §2.2, §5).

Order of the transforms (all on fp32):

1. temperature: ``temperature <= 0`` means greedy = one-hot of argmax (first index on ties);
   otherwise logits / temperature.
2. top-k: ``top_k <= 0`` or ``top_k >= V`` is off. Otherwise keep exactly the k largest
   tempered logits; ties are broken by the LOWER vocabulary index (a stable descending
   sort), so exactly k tokens survive even when logits tie.
3. top-p: ``top_p >= 1`` is off. Otherwise, on the (stable) descending-sorted distribution
   after top-k, keep the smallest prefix whose mass reaches top_p (token i is kept iff the
   mass strictly before it is < top_p); at least one token is always kept.
4. renormalise.

The top-k / top-p cut is found by bisection on the logits' order (no sort of the vocabulary;
`lax.top_k` for k <= 64); it keeps exactly the prefix a stable descending sort would.

Every parameter may be a python scalar, a traced jnp scalar, or a per-row array
broadcastable to ``logits.shape[:-1]``. :class:`SamplingParams` is a NamedTuple, hence a
pytree: pass it into ``jax.jit`` and its fields are traced (no recompilation per setting).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["SamplingParams", "sampling_probs", "sampling_path", "sample", "sample_with_noise", "exponential_noise",
           "all_greedy", "first_argmax", "probs_from_params"]


from dspark_jax.decoding.params import SamplingParams  # noqa: E402  (defined without jax)

# Top-k settings up to this many tokens take a path that sorts only the top TOPK_CAP logits.
TOPK_CAP = 64


def _truncate_sorted(s_logits, k, k_on, tp):
    """Top-k then top-p on logits sorted descending along the last axis -> probs (same order)."""
    rank = jnp.arange(s_logits.shape[-1], dtype=jnp.int32)
    keep_k = jnp.where(k_on[..., None], rank < k[..., None], True)
    s_logits = jnp.where(keep_k, s_logits, -jnp.inf)
    s_probs = jax.nn.softmax(s_logits, axis=-1)
    mass_before = jnp.cumsum(s_probs, axis=-1) - s_probs
    keep_p = (mass_before < tp[..., None]) | (rank == 0) | (tp >= 1.0)[..., None]
    s_probs = jnp.where(keep_p, s_probs, 0.0)
    return s_probs / jnp.sum(s_probs, axis=-1, keepdims=True)


def sampling_path(temperature, top_k, top_p, vocab_size: int) -> jax.Array:
    """Which of `sampling_probs`' paths serves every given row: 0 plain, 1 top-k <= TOPK_CAP,
    2 full sort; plus 3 when some row is greedy (its one-hot argmax is needed too). Settings
    known when the program is traced (constants, not arguments) give a Python int, so the
    program holds only that path (what a cost model can price: engine/predict.py).

    Pass it as `path=` when `sampling_probs` runs under a per-row `vmap`: computed there, the
    index would be batched and `lax.switch` would run all three paths (and the greedy argmax)
    for every row."""
    if not any(isinstance(x, jax.core.Tracer) for x in (temperature, top_k, top_p)):
        t, k, tp = (np.asarray(x, dt) for x, dt in zip((temperature, top_k, top_p),
                                                         (np.float32, np.int32, np.float32)))
        k_on = (k > 0) & (k < vocab_size)
        branch = 0 if np.all(~k_on & (tp >= 1.0)) else 1 if np.all(k_on & (k <= min(TOPK_CAP, vocab_size))) else 2
        return int(branch + 3 * bool(np.any(t <= 0.0)))
    t = jnp.asarray(temperature, jnp.float32)
    k = jnp.asarray(top_k, jnp.int32)
    tp = jnp.asarray(top_p, jnp.float32)
    k_on = (k > 0) & (k < vocab_size)
    no_trunc = jnp.all(~k_on & (tp >= 1.0))
    small = jnp.all(k_on & (k <= min(TOPK_CAP, vocab_size)))
    branch = jnp.where(no_trunc, 0, jnp.where(small, 1, 2))
    return (branch + 3 * jnp.any(t <= 0.0)).astype(jnp.int32)


def all_greedy(sampling) -> bool | None:
    """Whether every row of `sampling` (a `SamplingParams` of scalars or per-row arrays) is greedy,
    where that is known when traced (its temperatures constants, not arguments); None where it is
    not (the program must decide at run time). A program traced for greedy rows only needs no
    sampling noise and no distributions beyond the argmax's one-hot."""
    t = sampling.temperature
    if isinstance(t, jax.core.Tracer):
        return None
    return bool(np.all(np.asarray(t, np.float32) <= 0.0))


def first_argmax(x: jax.Array) -> jax.Array:
    """``argmax`` over the last axis, first index on ties: the row max, then the smallest index
    holding it. Same result as `jnp.argmax` (for NaN-free rows), about 3x faster on CPU than its
    index-tracking reduction at vocabulary width."""
    v = x.shape[-1]
    idx = jnp.arange(v, dtype=jnp.int32)
    first = jnp.min(jnp.where(x == jnp.max(x, axis=-1, keepdims=True), idx, v), axis=-1)
    return jnp.minimum(first, v - 1)


def _order_keys(x):
    """float32 -> uint32 keys in the same order (so bisection runs on integers: exact in 32 steps)."""
    u = jax.lax.bitcast_convert_type(jnp.where(x == 0.0, 0.0, x), jnp.uint32)  # -0.0 ties +0.0
    return jnp.where(u >> 31 == 1, ~u, u | jnp.uint32(0x80000000))


def _keep_prefix(keys, weight, limit):
    """The prefix of the order (keys descending, ties by lower index) whose weight strictly
    before each kept entry is < `limit` [...], without sorting: bisect (32 exact integer steps,
    one masked sum over V each) for the smallest key boundary b with weight above b < limit;
    the entries at the smallest key >= b are the only ties to split, by an index-order cumsum.
    With weight 1 this is top-k (count before < k); with the probabilities, top-p."""
    top = jnp.uint32(0xFFFFFFFF)

    def above(v):
        return jnp.sum(jnp.where(keys > v[..., None], weight, 0.0), axis=-1)

    def step(_, lohi):
        lo, hi = lohi
        mid = lo + (hi - lo) // 2
        ok = above(mid) < limit
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo = jnp.zeros(keys.shape[:-1], jnp.uint32)
    b, _ = jax.lax.fori_loop(0, 32, step, (lo, jnp.full_like(lo, top)))
    m = jnp.min(jnp.where(keys >= b[..., None], keys, top), axis=-1)
    tied = keys == m[..., None]
    w_tied = jnp.where(tied, weight, 0.0)
    before = above(m)[..., None] + jnp.cumsum(w_tied, axis=-1) - w_tied
    return (keys > m[..., None]) | (tied & (before < limit[..., None]))


def sampling_probs(logits: jax.Array, temperature=1.0, top_k=0, top_p=1.0, path=None) -> jax.Array:
    """fp32 probabilities ``[..., V]`` of the distribution that is sampled from (see module doc).

    Three paths with the same result, chosen at run time (the settings are traced): no
    truncation (a plain softmax, no sort); top-k <= TOPK_CAP (`lax.top_k`, which orders
    ties by lower index, then top-p inside those k); otherwise thresholds found by bisection
    (`_keep_prefix`: 32 passes over V for top-k, 32 for top-p, no sort of the vocabulary).
    `path`: the index from `sampling_path` over the whole batch (default: these rows').
    """
    logits = jnp.asarray(logits, jnp.float32)
    batch_shape, V = logits.shape[:-1], logits.shape[-1]
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), batch_shape)
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), batch_shape)
    tp = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), batch_shape)
    greedy = t <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, t)[..., None]
    k_on = (k > 0) & (k < V)
    cap = min(TOPK_CAP, V)

    def plain(_):
        return jax.nn.softmax(scaled, axis=-1)

    def small_k(_):
        vals, idx = jax.lax.top_k(scaled, cap)
        s_probs = _truncate_sorted(vals, k, k_on, tp)
        return jnp.put_along_axis(jnp.zeros_like(scaled), idx, s_probs, axis=-1, inplace=False)

    def bisect(_):
        keys = _order_keys(scaled)
        keep_k = _keep_prefix(keys, jnp.ones_like(scaled), k.astype(jnp.float32)) | ~k_on[..., None]
        probs = jax.nn.softmax(jnp.where(keep_k, scaled, -jnp.inf), axis=-1)
        first = jax.nn.one_hot(first_argmax(scaled), V, dtype=bool)  # at least one token survives
        keep_p = _keep_prefix(keys, probs, tp) | first | (tp >= 1.0)[..., None]
        probs = jnp.where(keep_p, probs, 0.0)
        return probs / jnp.sum(probs, axis=-1, keepdims=True)

    path = sampling_path(temperature, top_k, top_p, V) if path is None else path
    paths = (plain, small_k, bisect)

    def with_greedy_rows(probs):
        one_hot = jax.nn.one_hot(first_argmax(logits), V, dtype=jnp.float32)
        return jnp.where(greedy[..., None], one_hot, probs)

    if isinstance(path, int):  # known when traced: only that path is in the program
        probs = paths[path % 3](None)
        return with_greedy_rows(probs) if path >= 3 else probs
    probs = jax.lax.switch(path % 3, paths, None)

    # The argmax over V only when some row is greedy.
    return jax.lax.cond(path >= 3, with_greedy_rows, lambda p: p, probs)


def probs_from_params(logits: jax.Array, params: SamplingParams, path=None) -> jax.Array:
    """``sampling_probs(logits, *params, path=path)``."""
    return sampling_probs(logits, params.temperature, params.top_k, params.top_p, path=path)


def exponential_noise(key: jax.Array, shape) -> jax.Array:
    """Exp(1) draws ``-log(U)`` (U uniform on [tiny, 1), so the values are finite and > 0)."""
    u = jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny)
    return -jnp.log(u)


def sample_with_noise(probs: jax.Array, noise: jax.Array) -> jax.Array:
    """``argmax_i probs_i / E_i`` with E = `exponential_noise`: an exact draw from ``probs``.

    The exponential race: E_i / p_i is Exp(p_i), and the smallest of independent exponentials
    is i with probability p_i / sum(p). It is Gumbel-max (``-log E`` is Gumbel) without the
    logarithm of the probabilities: one log per entry instead of three. Zero-probability tokens
    score 0 and are never drawn, so a one-hot (greedy) row always yields its argmax.
    """
    return first_argmax(jnp.asarray(probs, jnp.float32) / noise)


def sample(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Token ids ``[...]`` drawn exactly from ``probs[..., V]`` (see `sample_with_noise`)."""
    return sample_with_noise(probs, exponential_noise(key, jnp.shape(probs)))
