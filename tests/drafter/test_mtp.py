"""MTP-1 baseline: training logits equal cached inference logits, rollback, loss.

Inputs are numpy arrays and every cache has one shape, so only the few shared jitted
functions below compile (eager jax ops compile per shape).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding.sampling import SamplingParams, sampling_probs
from dspark_jax.drafter.frozen import TargetMismatchError
from dspark_jax.drafter.mtp import (
    MTPDrafter,
    attach_target,
    create_cache,
    mtp_draft,
    mtp_draft_logits,
    mtp_loss,
    mtp_prefill,
    mtp_train_logits,
    mtp_update,
)
from dspark_jax.parallel.sharding import create_model, make_mesh
from dspark_jax.target import ModelConfig, RopeConfig

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope=RopeConfig(theta=10000.0))
S = 10
MAX_LEN = S + 4


def _create(factory):
    """Build with one jitted init (eager init compiles one random draw per parameter shape)."""
    return create_model(factory, mesh=make_mesh(devices=jax.devices()[:1]))


def _build(param_dtype=jnp.float32):
    def factory():
        d = MTPDrafter(CFG, rngs=nnx.Rngs(0), param_dtype=param_dtype)
        rng = np.random.default_rng(1)  # non-trivial norms, larger weights
        for v in [d.h_norm, d.e_norm, d.final_norm, d.proj] + [getattr(d.layer, n) for n in d.layer.names]:
            if len(v.shape) == 1:
                v.set_value(jnp.asarray(1 + 0.3 * rng.standard_normal(v.shape), param_dtype))
            else:
                v.set_value(v[...] * 5)
        return d

    return _create(factory)


@pytest.fixture(scope="module")
def params():
    return _build().arrays()


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (1, S)).astype(np.int32)
    hidden = rng.standard_normal((1, S, CFG.hidden_size)).astype(np.float32)
    return tokens, hidden


train_logits = jax.jit(partial(mtp_train_logits, cfg=CFG))
prefill = jax.jit(partial(mtp_prefill, cfg=CFG))
update = jax.jit(partial(mtp_update, cfg=CFG))
draft_logits = jax.jit(partial(mtp_draft_logits, cfg=CFG))
draft = jax.jit(partial(mtp_draft, cfg=CFG))
loss_fn = jax.jit(mtp_loss, static_argnames="soft_weight")


def _prefill(params, tokens, hidden, n, dtype=jnp.float32):
    """Cache holding positions 0..n-1 (hidden h_t with token x_{t+1}); always the same shapes."""
    valid = np.arange(S - 1)[None, :] < n
    return prefill(params, create_cache(CFG, 1, MAX_LEN, dtype), jnp.asarray(hidden[:, :S - 1], dtype),
                   tokens[:, 1:], valid)


def test_train_logits_equal_cached_inference(params, data):
    tokens, hidden = data
    tok2, hid2 = tokens.copy(), hidden.copy()  # right-padded copy with junk after S-3 tokens
    tok2[0, S - 3:] = 5
    hid2[0, S - 3:] = 50.0
    valid = np.array([[True] * S, [True] * (S - 3) + [False] * 3])
    lg = np.asarray(train_logits(params, np.concatenate([tokens, tok2]), np.concatenate([hidden, hid2]), valid))
    assert lg.shape == (2, S, CFG.vocab_size)
    np.testing.assert_allclose(lg[1, :S - 4], lg[0, :S - 4], atol=1e-4, rtol=1e-4)
    # Drafting position by position fills the cache (each draft commits its own position).
    cache = create_cache(CFG, 1, MAX_LEN)
    for t in range(S - 1):
        out, cache = draft_logits(params, cache, hidden[:, t], tokens[:, t + 1], np.asarray([t + 1]))
        assert int(cache.lengths[0]) == t + 1
        np.testing.assert_allclose(out[0], lg[0, t], atol=1e-4, rtol=1e-4, err_msg=f"t={t}")
    # A prefill of the prefix, then one draft, gives the same rows.
    for t in (0, 4, S - 2):
        out, _ = draft_logits(params, _prefill(params, tokens, hidden, t), hidden[:, t], tokens[:, t + 1],
                              np.asarray([t + 1]))
        np.testing.assert_allclose(out[0], lg[0, t], atol=1e-4, rtol=1e-4)
    assert np.abs(lg[0, 1] - lg[0, 0]).max() > 1e-2


def test_rollback_equals_fresh_cache(params, data):
    tokens, hidden = data
    p = 4
    key = jax.random.key(3)
    c = _prefill(params, tokens, hidden, p - 1)
    assert int(c.lengths[0]) == p - 1
    _, _, c = draft(key, params, c, hidden[:, p - 1], tokens[:, p], np.asarray([p]), SamplingParams())
    # Speculatively commit 3 positions (the last two with junk), then roll back to one accepted.
    junk = np.concatenate([hidden[:, p:p + 1], np.full((1, 2, CFG.hidden_size), 9.0, np.float32)], axis=1)
    c = update(params, c, junk, np.asarray([[tokens[0, p + 1], 3, 4]], np.int32))
    assert int(c.lengths[0]) == p + 3
    c = c.with_lengths(jnp.asarray([p + 1]))
    a = np.asarray([p + 2])
    rolled = draft(key, params, c, hidden[:, p + 1], tokens[:, p + 2], a, SamplingParams())
    fresh = draft(key, params, _prefill(params, tokens, hidden, p + 1), hidden[:, p + 1], tokens[:, p + 2], a,
                  SamplingParams())
    np.testing.assert_array_equal(rolled[0], fresh[0])
    np.testing.assert_allclose(rolled[1], fresh[1], atol=1e-5)
    assert rolled[0].shape == (1, 1) and rolled[1].shape == (1, 1, CFG.vocab_size)
    np.testing.assert_array_equal(rolled[2].lengths, a)
    # The junk keys are really there (beyond `lengths`), yet never read.
    assert np.abs(np.asarray(rolled[2].k[0, 0, :, p + 2]) - np.asarray(fresh[2].k[0, 0, :, p + 2])).max() > 1e-3


def test_draft_distribution_is_sampling_probs(params, data):
    tokens, hidden = data
    p = 6
    c = _prefill(params, tokens, hidden, p - 1)
    ap = np.asarray([p])
    sp = SamplingParams(0.7, 10, 0.9)
    tok, q, _ = draft(jax.random.key(0), params, c, hidden[:, p - 1], tokens[:, p], ap, sp)
    lg, _ = draft_logits(params, c, hidden[:, p - 1], tokens[:, p], ap)
    np.testing.assert_allclose(q[:, 0], sampling_probs(lg, 0.7, 10, 0.9), atol=1e-6)
    assert float(q[0, 0, int(tok[0, 0])]) > 0


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_is_label_ce_on_x_t_plus_2():
    rng = np.random.default_rng(2)
    s, v = 6, 7
    logits = rng.standard_normal((1, s, v)).astype(np.float32)
    target = rng.standard_normal((1, s, v)).astype(np.float32)
    tokens = np.array([[1, 2, 3, 4, 5, 6]])
    loss_mask = np.array([[0, 0, 1, 1, 0, 1]], bool)
    rows = [t for t in range(s) if t + 2 < s and loss_mask[0, t + 2]]  # labels x_2, x_3, x_5
    ce = [-_np_log_softmax(logits[0, t])[tokens[0, t + 2]] for t in rows]
    soft = [-(np.exp(_np_log_softmax(target[0, t + 1])) * _np_log_softmax(logits[0, t])).sum() for t in rows]
    np.testing.assert_allclose(loss_fn(logits, tokens, loss_mask), np.mean(ce), rtol=1e-5)
    got2 = loss_fn(logits, tokens, loss_mask, target_logits=target, soft_weight=0.5)
    np.testing.assert_allclose(got2, np.mean(ce) + 0.5 * np.mean(soft), rtol=1e-5)
    with pytest.raises(ValueError, match="target_logits"):
        mtp_loss(logits, tokens, loss_mask, soft_weight=1.0)


def test_attach_target_and_trainable_shapes(micro_target):
    cfg = micro_target.cfg
    d = _create(lambda: MTPDrafter(cfg, rngs=nnx.Rngs(0)))
    attach_target(d, micro_target)
    np.testing.assert_array_equal(d.embed[...], micro_target.embed[...])
    np.testing.assert_array_equal(d.lm_head[...], micro_target.lm_head_weight())
    assert d.proj.shape == (2 * cfg.hidden_size, cfg.hidden_size)
    assert d.layer.k_proj.get_metadata()["out_sharding"] == ("embed", "kv_heads")
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(d, nnx.Param)):
        assert cfg.vocab_size not in leaf.shape, path
    with pytest.raises(TargetMismatchError):
        attach_target(_build(), micro_target)
    with pytest.raises(ValueError, match="wide"):
        mtp_train_logits(d.arrays(), np.zeros((1, 3), np.int32), np.zeros((1, 3, 7)), cfg=cfg)


def test_bfloat16_smoke(params, data):
    tokens, hidden = data
    p16 = _build(jnp.bfloat16).arrays()
    p = 5
    c = _prefill(p16, tokens, hidden, p - 1, jnp.bfloat16)
    tok, q, _ = draft(jax.random.key(0), p16, c, jnp.asarray(hidden[:, p - 1], jnp.bfloat16), tokens[:, p],
                      np.asarray([p]), SamplingParams())
    assert tok.shape == (1, 1) and q.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(q)))
    c32 = _prefill(params, tokens, hidden, p - 1)
    lg, _ = draft_logits(params, c32, hidden[:, p - 1], tokens[:, p], np.asarray([p]))
    assert np.abs(np.asarray(q[0, 0]) - np.asarray(sampling_probs(lg[0]))).sum() < 0.2


def test_update_of_some_rows_needs_their_positions(params, data):
    """`rows=` without `at=` would write at the cache lengths of other slots: refused."""
    tokens, hidden = data
    c = _prefill(params, tokens, hidden, 3)
    with pytest.raises(ValueError, match="needs at="):
        mtp_update(params, c, hidden[:, 3:5], tokens[:, 4:6], cfg=CFG, rows=np.asarray([0], np.int32))
