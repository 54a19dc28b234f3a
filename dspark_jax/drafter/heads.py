"""Sequential heads on top of the backbone (docs/method.md §2.2), pure functions over the params dict.

`q_j = softmax(U_j + B_j)` with `U_j = lm_head(h_j)` and the head's bias B_j:
- vanilla (Markov): `B_j = W2(W1[x_{p+j}])`;
- gated: `g = sigmoid([h_j; W1[x]] @ gate_kernel + gate_bias)`, `B_j = W2(g * W1[x])`;
- rnn: `[g,c,o] = split3([s_{j-1}; W1[x]; h_j] @ joint_kernel + joint_bias)`,
  `s_j = sigmoid(g) s_{j-1} + (1 - sigmoid(g)) tanh(c)`, `B_j = W2(tanh(o))`, `s_{-1} = 0`;
- none (DFlash): `B_j = 0`, so slots are sampled independently.
The head type is read from which keys `params` holds, so these functions need no config.
Logits and biases are float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import (
    SamplingParams,
    all_greedy,
    exponential_noise,
    first_argmax,
    probs_from_params,
    sample_with_noise,
)
from dspark_jax.drafter.confidence import confidence_logits, prev_embed
from dspark_jax.parallel.sharding import constrain
from dspark_jax.target.layers import lm_head_logits

__all__ = ["head_type", "base_logits", "project_bias", "step_bias", "head_bias_train", "sample_block",
           "greedy_block"]


def head_type(params: dict) -> str | None:
    if "joint_kernel" in params:
        return "rnn"
    if "gate_kernel" in params:
        return "gated"
    if "markov_w1" in params:
        return "vanilla"
    return None


def base_logits(params: dict, h):
    """U = lm_head(h): [..., H] -> [..., V] float32."""
    return lm_head_logits(h, params["lm_head"])


def project_bias(params: dict, z):
    """W2 projection r -> V, float32. A 2-D matmul over the flattened rows: as a batched einsum,
    XLA (CPU) transposed the whole [rows, V] gradient to form W2's gradient in training."""
    w2 = params["markov_w2"].astype(z.dtype)
    out = jnp.dot(z.reshape(-1, z.shape[-1]), w2, preferred_element_type=jnp.float32)
    return out.reshape(*z.shape[:-1], w2.shape[1])


def _gate(params, h, e):
    x = jnp.concatenate([h, e.astype(h.dtype)], axis=-1)
    return jax.nn.sigmoid(x @ params["gate_kernel"] + params["gate_bias"])


def _rnn_step(params, s, e, h):
    """One recurrence step -> (s_j, tanh(o_j)) (the W2 input)."""
    x = jnp.concatenate([s, e.astype(h.dtype), h], axis=-1)
    g, c, o = jnp.split(x @ params["joint_kernel"] + params["joint_bias"], 3, axis=-1)
    g = jax.nn.sigmoid(g)
    return g * s + (1 - g) * jnp.tanh(c), jnp.tanh(o)


def init_state(params: dict, lead_shape, dtype):
    """Recurrent state s_{-1} = 0 (a 1-wide placeholder for memoryless heads)."""
    width = params["joint_kernel"].shape[1] // 3 if "joint_kernel" in params else 1
    return jnp.zeros((*lead_shape, width), dtype)


def step_bias(params: dict, state, h_j, prev_j):
    """One slot: (state, h_j [...,H] (None for the heads that do not read it: none, vanilla), prev
    token [...]) -> (state', B_j [...,V] float32)."""
    kind = head_type(params)
    if kind is None:
        return state, jnp.zeros((*jnp.shape(prev_j), params["lm_head"].shape[1]), jnp.float32)
    e = prev_embed(params, prev_j, None if h_j is None else h_j.dtype)
    if kind == "vanilla":
        return state, project_bias(params, e)
    if kind == "gated":
        return state, project_bias(params, _gate(params, h_j, e) * e)
    state, o = _rnn_step(params, state, e, h_j)
    return state, project_bias(params, o)


def head_bias_train(params: dict, h, prev_tokens):
    """Teacher-forced bias: h [..., G, H], prev_tokens [..., G] (x_{p+j}) -> B [..., G, V] float32.

    The RNN recurrence is unrolled with `lax.scan` over G; W2 is applied once outside it.
    """
    kind = head_type(params)
    if kind is None:
        return jnp.zeros((*h.shape[:-1], params["lm_head"].shape[1]), jnp.float32)
    e = prev_embed(params, prev_tokens, h.dtype)
    if kind == "vanilla":
        return project_bias(params, e)
    if kind == "gated":
        return project_bias(params, _gate(params, h, e) * e)

    def body(s, xs):
        h_j, e_j = xs
        s, o = _rnn_step(params, s, e_j, h_j)
        return s, o

    s0 = init_state(params, h.shape[:-2], h.dtype)
    _, outs = jax.lax.scan(body, s0, (jnp.moveaxis(h, -2, 0), jnp.moveaxis(e, -2, 0)))
    return project_bias(params, jnp.moveaxis(outs, 0, -2))


def _block_noise(key, r: int, g: int, v: int):
    """Every slot's Exp(1) sampling noise [G, R, V] in one batched draw before the head's scan: one
    key for the whole block (slot j draws with `fold_in(key, j)`), or one key per row ([R]: row r's
    slot j with `fold_in(key[r], j)`, the same values a block of that row alone would draw)."""
    if jnp.ndim(key) == 0:
        return jax.vmap(lambda j: exponential_noise(jax.random.fold_in(key, j), (r, v)))(jnp.arange(g))
    one = lambda k: jax.vmap(lambda j: exponential_noise(jax.random.fold_in(k, j), (1, v))[0])(jnp.arange(g))
    return jnp.moveaxis(jax.vmap(one)(key), 0, 1)


def sample_block(key, params: dict, h, anchor, sampling: SamplingParams = SamplingParams(), path=None,
                 greedy: bool | None = None):
    """Sample d_0..d_{G-1} left to right in ONE `lax.scan` over the G slots.

    h [R,G,H] (backbone output); anchor [R] (x_p, the previous token of slot 0); `key` one key for
    the block or one per row [R]; `sampling` scalars or per row [R].
    Slot j draws with key `jax.random.fold_in(key, j)` from
    `q_j = sampling_probs(U_j + B_j, sampling)`, B_j computed from the *sampled* previous
    token; z_j (confidence logit) likewise. Returns tokens [R,G] int32, q [R,G,V] float32
    (exactly the distributions sampled from), z [R,G] float32 (zeros without a
    confidence head). Without a Markov head (DFlash) B = 0. `path`: see `sampling.sampling_path`.

    When every row is greedy, each slot takes its argmax with no noise drawn and q is the tokens'
    one-hot (what `sampling_probs` gives a greedy row), built once after the scan. `greedy`
    (default `sampling.all_greedy`): True or False when known as the program is traced (only that
    head is in the program); otherwise both are and `lax.cond` picks at run time. The scan carries
    only what the next slot needs; the confidences (which read the sampled tokens, not feed them)
    are computed for the whole block after it.
    """
    r, g = h.shape[:2]
    u = constrain(base_logits(params, h), (None, None, "act_vocab"))
    v = u.shape[-1]
    greedy = all_greedy(sampling) if greedy is None else greedy

    def argmax_head(_):
        toks = _argmax_scan(params, u, h, anchor)
        return toks, constrain(jax.nn.one_hot(toks, v, dtype=jnp.float32), (None, None, "act_vocab"))

    def sampling_head(_):
        # the noise drawn before the scan: the scan body keeps only the V-wide softmax and one argmax
        noise = constrain(_block_noise(key, r, g, v), (None, None, "act_vocab"))

        def draw(u_j, b_j, noise_j):
            # the V-wide work split as the LM head's output is (over tensor), never gathered whole
            q_j = constrain(probs_from_params(constrain(u_j + b_j, (None, "act_vocab")), sampling, path),
                            (None, "act_vocab"))
            return sample_with_noise(q_j, noise_j), q_j

        toks, q = _head_scan(params, u, h, anchor, draw, noise)
        return toks, jnp.moveaxis(q, 0, 1)

    if greedy is None:
        every_row = jnp.all(jnp.asarray(sampling.temperature, jnp.float32) <= 0.0)
        toks, q = jax.lax.cond(every_row, argmax_head, sampling_head, None)
    else:
        toks, q = argmax_head(None) if greedy else sampling_head(None)
    return toks, q, block_confidence(params, h, anchor, toks)


def block_confidence(params: dict, h, anchor, toks):
    """z [R, G]: slot j's confidence from h_j and its previous token (the anchor, then the drafts)."""
    prev = jnp.concatenate([anchor[:, None].astype(jnp.int32), toks[:, :-1]], axis=1)
    return confidence_logits(params, h, prev)


def _head_scan(params: dict, u, h, anchor, draw, *extra):
    """The sequential head over the G slots: slot j's bias B_j from the previous slot's token, then
    `draw(u_j, b_j, *extra_j) -> (token [R], output)` -> (tokens [R, G], outputs stacked on [G, ...]).
    h rides in the scan only for the heads that read it (gated, rnn)."""
    with_h = head_type(params) in ("gated", "rnn")

    def body(carry, xs):
        prev, s = carry
        u_j, *rest = xs
        h_j, rest = (rest[0], rest[1:]) if with_h else (None, rest)
        s, b_j = step_bias(params, s, h_j, prev)
        tok, out = draw(u_j, b_j, *rest)
        return (tok.astype(jnp.int32), s), (tok.astype(jnp.int32), out)

    s0 = init_state(params, (h.shape[0],), h.dtype)
    slots = (jnp.moveaxis(u, 1, 0), *((jnp.moveaxis(h, 1, 0),) if with_h else ()), *extra)
    _, (toks, outs) = jax.lax.scan(body, (anchor.astype(jnp.int32), s0), slots)
    return toks.T, outs


def _argmax_scan(params: dict, u, h, anchor):
    """Each slot's argmax of U_j + B_j left to right, B_j from the previous slot's own token:
    u [R, G, V] (the LM head's logits), h [R, G, H] -> tokens [R, G] int32."""
    argmax = lambda u_j, b_j: (first_argmax(constrain(u_j + b_j, (None, "act_vocab"))), None)
    return _head_scan(params, u, h, anchor, argmax)[0]


def greedy_block(params: dict, h, anchor):
    """`sample_block` at temperature 0 (each slot's argmax, previous slots' own tokens feeding the
    head) without what sampling needs: no noise, no distributions. -> tokens [R, G] int32, z [R, G]."""
    toks = _argmax_scan(params, base_logits(params, h), h, anchor)
    return toks, block_confidence(params, h, anchor, toks)
