"""Sequential heads and confidence head: numpy references, scan == Python loop, teacher
forcing == inference, DFlash independence, no retracing on new data."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding.sampling import SamplingParams, sample, sampling_probs
from dspark_jax.drafter import confidence_logits, head_bias_train, registry, sample_block
from dspark_jax.drafter.heads import base_logits
from dspark_jax.drafter.losses import soft_label
from dspark_jax.parallel.sharding import create_model

R, H, V = 3, 64, 512


def _sig(x):
    return 1 / (1 + np.exp(-x))


@pytest.fixture(scope="module")
def params(micro_cfg):
    """kind -> params dict (float32) with random non-zero biases."""
    out = {}
    for i, (kind, head) in enumerate([("dspark", "vanilla"), ("dspark", "gated"),
                                      ("dspark", "rnn"), ("dflash", "vanilla")]):
        dcfg = dataclasses.replace(micro_cfg.drafter, kind=kind, head_type=head)
        d = create_model(lambda: registry.build(micro_cfg.target.model, dcfg, rngs=nnx.Rngs(i)))
        p = jax.tree.map(np.asarray, d.arrays())
        rng = np.random.default_rng(i)
        for k in ("gate_bias", "joint_bias", "conf_bias"):
            if k in p:
                p[k] = rng.normal(0, 0.5, p[k].shape).astype(np.float32)
        for k in ("markov_w1", "markov_w2", "gate_kernel", "joint_kernel", "conf_kernel"):
            if k in p:  # larger than init so the heads matter
                p[k] = (p[k] * 25).astype(np.float32)
        out[head if kind == "dspark" else "dflash"] = jax.tree.map(jnp.asarray, p)
    return out


def _np_bias(p, kind, h, prev, state):
    """Numpy reference of one slot: h [R,H], prev [R] -> (state, bias [R,V])."""
    p = {k: np.asarray(v, np.float64) for k, v in p.items() if k != "layers"}
    if kind == "dflash":
        return state, np.zeros((h.shape[0], V))
    e = p["markov_w1"][prev]
    if kind == "vanilla":
        return state, e @ p["markov_w2"]
    if kind == "gated":
        g = _sig(np.concatenate([h, e], -1) @ p["gate_kernel"] + p["gate_bias"])
        return state, (g * e) @ p["markov_w2"]
    z = np.concatenate([state, e, h], -1) @ p["joint_kernel"] + p["joint_bias"]
    r = e.shape[-1]
    g, c, o = _sig(z[:, :r]), np.tanh(z[:, r:2 * r]), np.tanh(z[:, 2 * r:])
    return g * state + (1 - g) * c, o @ p["markov_w2"]


def _np_conf(p, h, prev):
    if "conf_kernel" not in p:
        return np.zeros(h.shape[0])
    k = np.asarray(p["conf_kernel"], np.float64)
    x = np.concatenate([h, np.asarray(p["markov_w1"], np.float64)[prev]], -1) if k.shape[0] != h.shape[-1] else h
    return (x @ k)[:, 0] + float(p["conf_bias"][0])


KINDS = ["vanilla", "gated", "rnn", "dflash"]
SETTINGS = [SamplingParams(1.0, 0, 1.0), SamplingParams(0.7, 20, 0.9), SamplingParams(0.0, 0, 1.0)]


@pytest.fixture(scope="module")
def sample_fn():
    return jax.jit(sample_block)


_probs = jax.jit(sampling_probs)
_sample = jax.jit(lambda key, j, q: sample(jax.random.fold_in(key, j), q))


@pytest.mark.parametrize("kind,G", [(k, 4) for k in KINDS] + [("rnn", 1), ("rnn", 7), ("gated", 15), ("dflash", 7)])
def test_scan_equals_python_loop_and_teacher_forcing(params, sample_fn, kind, G):
    p = params[kind]
    rng = np.random.default_rng(G)
    h = jnp.asarray(rng.normal(0, 1, (R, G, H)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, V, R), jnp.int32)
    key = jax.random.key(G)
    for sp in SETTINGS[:1] if G in (1, 15) else SETTINGS:
        toks, q, z = sample_fn(key, p, h, anchor, sp)
        toks, q, z = np.asarray(toks), np.asarray(q), np.asarray(z)
        # plain Python loop, numpy head math, same per-slot keys fold_in(key, j)
        u = np.asarray(h, np.float64) @ np.asarray(p["lm_head"], np.float64)
        prev, state = np.asarray(anchor), np.zeros((R, p["joint_kernel"].shape[1] // 3 if kind == "rnn" else 1))
        for j in range(G):
            state, b = _np_bias(p, kind, np.asarray(h[:, j], np.float64), prev, state)
            qj = _probs(jnp.asarray(u[:, j] + b, jnp.float32), *sp)
            np.testing.assert_allclose(q[:, j], np.asarray(qj), atol=2e-5)
            np.testing.assert_allclose(z[:, j], _np_conf(p, np.asarray(h[:, j], np.float64), prev), atol=1e-4)
            tj = np.asarray(_sample(key, j, jnp.asarray(q[:, j])))
            np.testing.assert_array_equal(toks[:, j], tj)
            prev = tj
        # teacher forcing with the scan's own samples reproduces the inference q and z
        teacher_prev = jnp.asarray(np.concatenate([np.asarray(anchor)[:, None], toks[:, :-1]], 1))
        logits = base_logits(p, h) + head_bias_train(p, h, teacher_prev)
        np.testing.assert_allclose(np.asarray(_probs(logits, *sp)), q, atol=2e-5)
        np.testing.assert_allclose(np.asarray(confidence_logits(p, h, teacher_prev)), z, atol=1e-5)
        if sp.temperature == 0.0:
            np.testing.assert_array_equal(toks, np.argmax(np.asarray(logits), -1))


def test_teacher_forced_bias_uses_given_tokens(params):
    """head_bias_train with arbitrary teacher tokens equals the numpy recurrence (batch dims [2,3])."""
    rng = np.random.default_rng(1)
    G = 5
    h = rng.normal(0, 1, (2, 3, G, H)).astype(np.float32)
    prev = rng.integers(0, V, (2, 3, G))
    for kind in KINDS:
        p = params[kind]
        got = np.asarray(head_bias_train(p, jnp.asarray(h), jnp.asarray(prev)))
        hf, pf = h.reshape(6, G, H).astype(np.float64), prev.reshape(6, G)
        state = np.zeros((6, p["joint_kernel"].shape[1] // 3 if kind == "rnn" else 1))
        for j in range(G):
            state, b = _np_bias(p, kind, hf[:, j], pf[:, j], state)
            np.testing.assert_allclose(got.reshape(6, G, V)[:, j], b, atol=1e-4)


def test_dflash_slots_are_independent(params, sample_fn):
    p = params["dflash"]
    assert "markov_w1" not in p and "conf_kernel" not in p
    h = jax.random.normal(jax.random.key(0), (R, 4, H))
    toks, q, z = sample_fn(jax.random.key(1), p, h, jnp.zeros((R,), jnp.int32), SamplingParams())
    np.testing.assert_allclose(np.asarray(q), np.asarray(jax.nn.softmax(base_logits(p, h), -1)), atol=1e-6)
    assert not np.asarray(z).any()


def test_bfloat16_heads_close_to_float32(params):
    p = params["rnn"]
    h = jax.random.normal(jax.random.key(0), (R, 4, H))
    prev = jax.random.randint(jax.random.key(1), (R, 4), 0, V)
    ref = np.asarray(head_bias_train(p, h, prev))
    pb = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p)
    got = head_bias_train(pb, h.astype(jnp.bfloat16), prev)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(got), ref, atol=0.05 * np.abs(ref).max())
    assert confidence_logits(pb, h.astype(jnp.bfloat16), prev).dtype == jnp.float32


def test_soft_label():
    q = jnp.array([[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    p = jnp.array([[0.7, 0.3, 0.0], [0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    np.testing.assert_allclose(np.asarray(soft_label(q, p)), [0.8, 0.0, 1.0], atol=1e-6)
    # detached: no gradient flows into q or p
    g = jax.grad(lambda q: soft_label(q, p).sum())(q)
    assert not np.asarray(g).any()


def test_no_retrace_on_new_data(params):
    traces = []

    @jax.jit
    def f(key, p, h, anchor, sp):
        traces.append(1)
        return sample_block(key, p, h, anchor, sp)

    p = params["rnn"]
    for i in range(3):
        h = jax.random.normal(jax.random.key(i), (R, 4, H))
        sp = SamplingParams(jnp.float32(0.5 + i), jnp.int32(i * 5), jnp.float32(0.9))
        p_i = jax.tree.map(lambda a: a * (1 + 0.01 * i), p)
        f(jax.random.key(i), p_i, h, jnp.full((R,), i, jnp.int32), sp)
    assert len(traces) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_block_is_sample_block_at_temperature_zero(params, sample_fn, kind):
    """The noise-free greedy head (teacher-forced evaluation) draws what sampling at T = 0 draws,
    with the same confidences, for every head type."""
    from dspark_jax.drafter.heads import greedy_block

    p = params[kind]
    rng = np.random.default_rng(3)
    h = jnp.asarray(rng.normal(0, 1, (R, 7, H)), jnp.float32)
    anchor = jnp.asarray(rng.integers(0, V, R), jnp.int32)
    toks, _, z = sample_fn(jax.random.key(0), p, h, anchor, SamplingParams(0.0, 0, 1.0))
    g_toks, g_z = jax.jit(greedy_block)(p, h, anchor)
    np.testing.assert_array_equal(np.asarray(g_toks), np.asarray(toks))
    np.testing.assert_allclose(np.asarray(g_z), np.asarray(z), atol=1e-6)
    assert len({tuple(r) for r in np.asarray(toks)}) > 1  # rows differ: not a constant output
