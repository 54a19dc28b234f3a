"""Eagle3 baseline: the training-time test sees what inference sees, TTT mask, loss, rollback.

Inputs are numpy arrays and the drafter is built by one jitted init, so the module
compiles only the few shared jitted functions below (eager jax ops compile per shape).
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding.sampling import SamplingParams, sampling_probs
from dspark_jax.drafter.eagle3 import (
    Eagle3Drafter,
    attach_target,
    create_cache,
    eagle3_draft,
    eagle3_draft_logits,
    eagle3_logits,
    eagle3_loss,
    eagle3_prefill,
    eagle3_train_hidden,
    eagle3_train_logits,
    eagle3_update,
    ttt_mask,
)
from dspark_jax.drafter.frozen import Frozen, TargetMismatchError
from dspark_jax.parallel.sharding import create_model, make_mesh
from dspark_jax.target import ModelConfig, RopeConfig

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=4, num_heads=4, num_kv_heads=2,
                  head_dim=8, rope=RopeConfig(theta=10000.0))
M, S, STEPS, G, R = 2, 12, 4, 4, 4
MAX_LEN = S + G + 2


def _build(param_dtype=jnp.float32):
    def factory():
        d = Eagle3Drafter(CFG, M, rngs=nnx.Rngs(0), ttt_steps=STEPS, param_dtype=param_dtype)
        # Non-trivial norms so every norm is exercised; larger weights so the steps differ visibly.
        rng = np.random.default_rng(1)
        for name in d.layer.names:
            v = getattr(d.layer, name)
            if name.endswith("norm"):
                v.set_value(jnp.asarray(1 + 0.3 * rng.standard_normal(v.shape), param_dtype))
            else:
                v.set_value(v[...] * 5)
        d.fc.set_value(d.fc[...] * 5)
        return d

    return _create(factory)


def _create(factory):
    """Build with one jitted init (eager init compiles one random draw per parameter shape)."""
    return create_model(factory, mesh=make_mesh(devices=jax.devices()[:1]))


@pytest.fixture(scope="module")
def drafter():
    return _build()


@pytest.fixture(scope="module")
def params(drafter):
    return drafter.arrays()


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, CFG.vocab_size, (1, S)).astype(np.int32)
    feats = rng.standard_normal((1, S, M, CFG.hidden_size)).astype(np.float32)
    return tokens, feats


@pytest.fixture(scope="module")
def batch(data):
    """Two rows: the sequence, and a copy right-padded with junk after S-3 tokens (must not matter)."""
    tokens, feats = data
    tok2, ft2 = tokens.copy(), feats.copy()
    tok2[0, S - 3:] = np.random.default_rng(5).integers(0, CFG.vocab_size, 3)
    ft2[0, S - 3:] = 100.0
    valid = np.array([[True] * S, [True] * (S - 3) + [False] * 3])
    return np.concatenate([tokens, tok2]), np.concatenate([feats, ft2]), valid


train_logits = jax.jit(partial(eagle3_train_logits, cfg=CFG, ttt_steps=STEPS))
prefill = jax.jit(partial(eagle3_prefill, cfg=CFG))
update = jax.jit(partial(eagle3_update, cfg=CFG))
draft_logits = jax.jit(partial(eagle3_draft_logits, cfg=CFG))
draft = jax.jit(partial(eagle3_draft, cfg=CFG), static_argnames="gamma")
loss_fn = jax.jit(eagle3_loss, static_argnames=("decay", "normalizer"))


def _prefill_rows(params, tokens, feats, anchors, dtype=jnp.float32):
    """One cache row per anchor p: features f_0..f_{p-2} with tokens x_1..x_{p-1}."""
    assert len(anchors) == R  # one compiled shape for every test
    n = np.array([p - 1 for p in anchors])
    valid = np.arange(S)[None, :] < n[:, None]
    toks = np.broadcast_to(np.roll(tokens, -1, axis=1), (R, S))
    fts = np.broadcast_to(feats, (R, *feats.shape[1:]))
    return prefill(params, create_cache(CFG, R, MAX_LEN, dtype), jnp.asarray(fts, dtype), toks, valid)


def test_ttt_step_s_equals_inference_step_s(params, data, batch):
    tokens, feats = data
    ttt = np.asarray(train_logits(params, *batch))
    assert ttt.shape == (STEPS, 2, S, CFG.vocab_size)
    for s in range(STEPS):  # rows whose inputs all lie inside the valid prefix agree
        n = S - 3 - s - 1
        np.testing.assert_allclose(ttt[s, 1, :n], ttt[s, 0, :n], atol=1e-4, rtol=1e-4)

    anchors = [1, 3, 6, S - STEPS]  # step s at index p-1 feeds x_{p+s}: needs p+STEPS-1 <= S-1
    cache = _prefill_rows(params, tokens, feats, anchors)
    np.testing.assert_array_equal(cache.lengths, [p - 1 for p in anchors])
    ap = np.asarray(anchors, np.int32)
    step_tokens = np.stack([tokens[0, p:p + STEPS] for p in anchors])
    inf, cache2 = draft_logits(params, cache, feats[0, ap - 1], step_tokens, ap)
    np.testing.assert_array_equal(cache2.lengths, anchors)
    inf = np.asarray(inf)
    for r, p in enumerate(anchors):
        for s in range(STEPS):
            np.testing.assert_allclose(inf[r, s], ttt[s, 0, p - 1], atol=1e-4, rtol=1e-4, err_msg=f"p={p} step={s}")
    # The steps really differ (a test that ignored step > 0 inputs would not pass above).
    assert np.abs(ttt[1, 0] - ttt[0, 0]).max() > 1e-2


def test_ttt_mask_structure():
    m = np.asarray(ttt_mask(jnp.asarray([[True, True, False]]), 1))[0].astype(int)
    expected = np.array([
        # step-0 keys  step-1 keys
        [1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 0, 0, 0, 0],  # index 2 is padding: its keys are hidden, even its own
    ])
    np.testing.assert_array_equal(m, expected)
    m2 = np.asarray(ttt_mask(jnp.ones((1, 4), bool), 2))[0]
    assert m2.shape == (4, 12)
    for i in range(4):
        assert list(np.nonzero(m2[i])[0]) == list(range(i + 1)) + [4 + i, 8 + i]


def _np_log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def test_loss_weights_and_per_step_normalisation():
    rng = np.random.default_rng(3)
    steps, s, v = 3, 6, 5
    logits = rng.standard_normal((steps, 1, s, v)).astype(np.float32)
    target = rng.standard_normal((1, s, v)).astype(np.float32)
    loss_mask = np.array([[0, 1, 1, 0, 1, 1]], bool)
    loss, per_step = loss_fn(logits, target, loss_mask)
    loss_t, per_step_t = loss_fn(logits, target, loss_mask, normalizer="tokens")
    want, want_t = [], []
    for st in range(steps):
        tot, cnt = 0.0, 0
        for i in range(s):
            lab = i + st + 2  # row (st, i) predicts x_{i+st+2}, scored against target row i+st+1
            if lab < s and loss_mask[0, lab]:
                p = np.exp(_np_log_softmax(target[0, lab - 1]))
                tot += -(p * _np_log_softmax(logits[st, 0, i])).sum()
                cnt += 1
        want.append(tot / cnt)
        want_t.append(tot / s)
    # valid rows per step: labels {2,4,5} -> 3, {4,5} -> 2, {4,5} -> 2: each step has its own denominator
    np.testing.assert_allclose(per_step, want, rtol=1e-5)
    np.testing.assert_allclose(loss, want[0] + 0.8 * want[1] + 0.64 * want[2], rtol=1e-5)
    np.testing.assert_allclose(per_step_t, want_t, rtol=1e-5)
    np.testing.assert_allclose(loss_t, want_t[0] + 0.8 * want_t[1] + 0.64 * want_t[2], rtol=1e-5)
    with pytest.raises(ValueError, match="normalizer"):
        eagle3_loss(logits, target, loss_mask, normalizer="mean")


def test_loss_gradient_reaches_trainables_only(drafter, data):
    tokens, feats = data
    target_logits = np.random.default_rng(4).standard_normal((1, S, CFG.vocab_size)).astype(np.float32)
    graphdef, trainable, frozen = nnx.split(drafter, nnx.Param, Frozen)
    mask = np.ones((1, S), bool)

    def f(tr):
        p = nnx.merge(graphdef, tr, frozen).arrays()
        hid = eagle3_train_hidden(p, tokens, feats, cfg=CFG, ttt_steps=2)
        via_hidden = eagle3_loss(hid, target_logits, mask, logits_fn=partial(eagle3_logits, p))[0]
        via_logits = eagle3_loss(eagle3_logits(p, hid), target_logits, mask)[0]
        return via_hidden, via_logits

    (loss, loss_ref), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(trainable)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    leaves = jax.tree.leaves(grads)
    assert leaves and all(CFG.vocab_size not in g.shape for g in leaves)
    assert all(float(jnp.max(jnp.abs(g))) > 0 for g in leaves)


def test_draft_samples_what_it_reports_and_feeds_samples_back(params, data):
    tokens, feats = data
    anchors = [2, 5, 1, 7]
    cache = _prefill_rows(params, tokens, feats, anchors)
    ap = np.asarray(anchors, np.int32)
    anchor_tok, last = tokens[0, ap], feats[0, ap - 1]
    sp = SamplingParams(temperature=0.8, top_k=20, top_p=0.95)
    toks, q, c = draft(jax.random.key(7), params, cache, last, anchor_tok, ap, gamma=G, sampling=sp)
    toks, q = np.asarray(toks), np.asarray(q)
    assert toks.shape == (R, G) and q.shape == (R, G, CFG.vocab_size)
    np.testing.assert_array_equal(c.lengths, anchors)
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-5)
    assert (np.take_along_axis(q, toks[..., None], -1) > 0).all()
    fed = np.concatenate([anchor_tok[:, None], toks[:, :-1]], axis=1)
    lg, _ = draft_logits(params, cache, last, fed, ap)
    np.testing.assert_allclose(q, sampling_probs(lg, 0.8, 20, 0.95), atol=1e-5)
    greedy, _, _ = draft(jax.random.key(8), params, cache, last, anchor_tok, ap, gamma=G, sampling=SamplingParams(0.0))
    greedy = np.asarray(greedy)
    lg_g, _ = draft_logits(params, cache, last, np.concatenate([anchor_tok[:, None], greedy[:, :-1]], 1), ap)
    np.testing.assert_array_equal(greedy, np.argmax(lg_g, -1))
    with pytest.raises(ValueError, match="gamma"):
        eagle3_draft(jax.random.key(0), params, cache, last, anchor_tok, ap, 0, cfg=CFG)


def test_rollback_equals_fresh_cache(params, data):
    tokens, feats = data
    rng = np.random.default_rng(9)
    anchors, a = [3, 5, 2, 6], np.array([2, 0, 1, 3])
    ap = np.asarray(anchors, np.int32)
    cache = _prefill_rows(params, tokens, feats, anchors)
    key = jax.random.key(11)
    toks, _, cache = draft(key, params, cache, feats[0, ap - 1], tokens[0, ap], ap, gamma=G, sampling=SamplingParams())
    cache_after_draft = cache
    # Verification gives features for positions p..p+a (random here); the committed tokens
    # x_{p+1}..x_{p+a} are the accepted drafts; the bonus token is the new anchor at p+a+1.
    new_feats = rng.standard_normal((R, 4, M, CFG.hidden_size)).astype(np.float32)
    bonus = np.array([17, 42, 5, 60], np.int32)
    valid = np.arange(3)[None, :] < a[:, None]
    commit_tok = np.where(valid, np.asarray(toks)[:, :3], 0).astype(np.int32)
    cache = update(params, cache, new_feats[:, :3], commit_tok, valid)
    new_anchor = ap + a + 1
    np.testing.assert_array_equal(cache.lengths, new_anchor - 1)
    last = new_feats[np.arange(R), a]
    out_roll = draft(key, params, cache, last, bonus, new_anchor, gamma=G, sampling=SamplingParams())

    # Fresh cache: the whole committed history in one prefill (padded to S: the same compiled shape).
    full_feats = np.zeros((R, S, M, CFG.hidden_size), np.float32)
    full_toks = np.zeros((R, S), np.int32)
    for r, p in enumerate(anchors):
        full_feats[r, :p] = feats[0, :p]
        full_feats[r, p:p + a[r]] = new_feats[r, :a[r]]
        full_toks[r, :p] = tokens[0, 1:p + 1]
        full_toks[r, p:p + a[r]] = commit_tok[r, :a[r]]
    fvalid = np.arange(S)[None, :] < (new_anchor - 1)[:, None]
    fresh = prefill(params, create_cache(CFG, R, MAX_LEN), full_feats, full_toks, fvalid)
    out_fresh = draft(key, params, fresh, last, bonus, new_anchor, gamma=G, sampling=SamplingParams())
    np.testing.assert_array_equal(out_roll[0], out_fresh[0])
    np.testing.assert_allclose(out_roll[1], out_fresh[1], atol=1e-5)
    # Skipping the update (taking the draft's own keys as committed) gives a different draft.
    no_update = draft(key, params, cache_after_draft.with_lengths(new_anchor - 1), last, bonus, new_anchor,
                      gamma=G, sampling=SamplingParams())
    assert np.abs(np.asarray(no_update[1][0]) - np.asarray(out_fresh[1][0])).max() > 1e-3


def test_attach_target_params_and_axes(drafter, micro_target):
    cfg = micro_target.cfg
    d = _create(lambda: Eagle3Drafter(cfg, 1, rngs=nnx.Rngs(0)))
    attach_target(d, micro_target)
    np.testing.assert_array_equal(d.embed[...], micro_target.embed[...])
    np.testing.assert_array_equal(d.lm_head[...], micro_target.lm_head_weight())
    h = cfg.hidden_size
    assert d.layer.q_proj.shape == (2 * h, cfg.num_heads * cfg.head_dim)
    assert d.layer.q_proj.get_metadata()["out_sharding"] == ("embed", "heads")
    assert d.fc.shape == (h, h)
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(d, nnx.Param)):
        assert cfg.vocab_size not in leaf.shape, path
    with pytest.raises(TargetMismatchError, match="embedding"):
        attach_target(drafter, micro_target)
    with pytest.raises(ValueError, match="m=1"):
        eagle3_train_logits(d.arrays(), np.zeros((1, 4), np.int32), np.zeros((1, 4, 2, h)), cfg=cfg, ttt_steps=1)
    with pytest.raises(ValueError, match="ttt_steps"):
        Eagle3Drafter(cfg, 1, rngs=nnx.Rngs(0), ttt_steps=0)


def test_bfloat16_smoke(params, data):
    tokens, feats = data
    p16 = _build(jnp.bfloat16).arrays()
    anchors = [1, 3, 5, 8]
    ap = np.asarray(anchors, np.int32)
    c = _prefill_rows(p16, tokens, feats, anchors, jnp.bfloat16)
    last = feats[0, ap - 1]
    toks, q, _ = draft(jax.random.key(0), p16, c, jnp.asarray(last, jnp.bfloat16), tokens[0, ap], ap, gamma=G,
                       sampling=SamplingParams())
    assert toks.shape == (R, G) and q.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(q)))
    np.testing.assert_allclose(q.sum(-1), 1.0, atol=1e-3)
    # Step 0 (fed the anchor) is close to float32.
    fed = np.concatenate([tokens[0, ap][:, None], np.asarray(toks)[:, :-1]], axis=1)
    lg32, _ = draft_logits(params, _prefill_rows(params, tokens, feats, anchors), last, fed, ap)
    q32 = np.asarray(sampling_probs(lg32[:, 0]))
    assert np.abs(np.asarray(q[:, 0]) - q32).sum(-1).max() < 0.2


def test_update_of_some_rows_needs_their_positions(params, data):
    """`rows=` without `at=` would write at the cache lengths of other slots: refused."""
    tokens, feats = data
    cache = _prefill_rows(params, tokens, feats, [3, 5, 2, 6])
    with pytest.raises(ValueError, match="needs at="):
        eagle3_update(params, cache, feats[:, 3:5], tokens[:, 4:6], cfg=CFG, rows=np.asarray([0], np.int32))
