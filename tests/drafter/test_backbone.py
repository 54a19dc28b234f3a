"""Drafter backbone: the training attention pattern, a dense reference forward, and
training / inference (context cache) agreement."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.drafter import attach_target, registry
from dspark_jax.drafter.backbone import backbone_train, draft_hidden, fuse_context, training_mask, update_context
from dspark_jax.parallel.sharding import create_model
from dspark_jax.target.layers import apply_rope, attention, rms_norm, rope_cos_sin, rope_inv_freq, swiglu


def _mask_reference(anchors, keep, S, G, window=None):
    B, A = anchors.shape
    out = np.zeros((B, A * G, S + A * G), bool)
    for b in range(B):
        for i in range(A * G):
            a = i // G
            if not keep[b, a]:
                continue
            p = anchors[b, a]
            for s in range(S):
                out[b, i, s] = s < p and (window is None or s >= p - window)
            out[b, i, S + a * G: S + (a + 1) * G] = True
    return out


@pytest.mark.parametrize("window", [None, 2])
def test_training_mask_structure(window):
    # overlapping anchors (2, 3), an anchor near the end (8 with G=3 runs past S=10),
    # anchor 0 (sees no context), and a padded (dummy) block.
    anchors = np.array([[2, 3, 8, 0, 5], [0, 1, 9, 9, 4]])
    keep = np.array([[True, True, True, True, False], [True, True, True, False, False]])
    got = np.asarray(training_mask(jnp.asarray(anchors), jnp.asarray(keep), 10, 3, window))
    np.testing.assert_array_equal(got, _mask_reference(anchors, keep, 10, 3, window))
    # spot checks of the rules themselves
    assert not got[0, 12:15].any()  # dummy block (a=4) sees nothing
    assert got[0, 0, 10:13].all() and not got[0, 0, 13:16].any()  # own block only, not the overlapping next one
    assert got[0, 3, :3].sum() == (3 if window is None else 2) and not got[0, 3, 3]  # block at p=3: ctx < 3


@pytest.fixture(scope="module")
def setup(micro_cfg, micro_target):
    drafter = create_model(lambda: registry.build(micro_cfg.target.model, micro_cfg.drafter, rngs=nnx.Rngs(3)))
    attach_target(drafter, micro_target)
    rng = np.random.default_rng(0)
    B, S = 2, 24
    tokens = jnp.asarray(rng.integers(0, 500, (B, S)), jnp.int32)
    feats = micro_target(tokens, feature_layers=drafter.layer_ids, return_logits=False).features
    # non-trivial norms so that skipping / misplacing a norm shows
    layers = drafter.layers
    for name in ("input_norm", "post_norm", "q_norm", "k_norm"):
        v = getattr(layers, name)
        v.set_value(1.0 + 0.3 * jax.random.normal(jax.random.key(hash(name) % 1000), v.shape))
    drafter.hidden_norm.set_value(1.0 + 0.3 * jax.random.normal(jax.random.key(7), drafter.hidden_norm.shape))
    return drafter, tokens, feats


def _dense_reference(p, cfg, tokens, ctx, anchors, keep, G, mask_id, window=None):
    """Independent forward: one dense attention over [ctx keys; all block keys] with training_mask."""
    B, S = tokens.shape
    A = anchors.shape[1]
    eps, nq, nkv, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ids = jnp.where(jnp.arange(G)[None, None] == 0, jnp.take_along_axis(tokens, anchors, 1)[..., None], mask_id)
    x = p["embed"][ids].reshape(B, A * G, -1)
    inv = rope_inv_freq(d, cfg.rope)
    cb, sb = rope_cos_sin((anchors[..., None] + jnp.arange(G)).reshape(B, A * G), inv)
    cc, sc = rope_cos_sin(jnp.broadcast_to(jnp.arange(S), (B, S)), inv)
    mask = training_mask(anchors, keep, S, G, window)
    for l in range(cfg.num_layers):
        lp = {k: v[l] for k, v in p["layers"].items()}
        hn = rms_norm(x, lp["input_norm"], eps)
        q = rms_norm((hn @ lp["q_proj"]).reshape(B, -1, nq, d), lp["q_norm"], eps)
        k = rms_norm((hn @ lp["k_proj"]).reshape(B, -1, nkv, d), lp["k_norm"], eps)
        v = (hn @ lp["v_proj"]).reshape(B, -1, nkv, d)
        kc = rms_norm((ctx @ lp["k_proj"]).reshape(B, S, nkv, d), lp["k_norm"], eps)  # no input norm on ctx
        vc = (ctx @ lp["v_proj"]).reshape(B, S, nkv, d)
        q, k, kc = apply_rope(q, cb, sb), apply_rope(k, cb, sb), apply_rope(kc, cc, sc)
        out = attention(q, jnp.concatenate([kc, k], 1), jnp.concatenate([vc, v], 1), mask)
        x = x + out.reshape(B, A * G, -1) @ lp["o_proj"]
        x = x + swiglu(rms_norm(x, lp["post_norm"], eps), lp["gate_proj"], lp["up_proj"], lp["down_proj"])
    return rms_norm(x, p["final_norm"], eps).reshape(B, A, G, -1)


@pytest.mark.parametrize("window", [None, 3])
def test_backbone_train_equals_dense_reference(setup, window):
    drafter, tokens, feats = setup
    p, cfg = drafter.arrays(), drafter.cfg
    ctx = fuse_context(p, feats, cfg)
    anchors = np.array([[0, 3, 4, 20, 22, 5], [1, 2, 7, 7, 15, 0]])
    keep = np.array([[True, True, True, True, True, False], [True, True, True, True, False, False]])
    G = 4
    got = backbone_train(p, cfg, tokens, ctx, jnp.asarray(anchors), jnp.asarray(keep),
                         gamma=G, mask_id=511, window=window)
    ref = jax.jit(_dense_reference, static_argnums=(1, 6, 7, 8))(p, cfg, tokens, ctx, jnp.asarray(anchors),
                                                                 jnp.asarray(keep), G, 511, window)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got)[keep], np.asarray(ref)[keep], atol=2e-5)


def test_blocks_see_only_context_before_anchor_and_themselves(setup):
    drafter, tokens, feats = setup
    p, cfg = drafter.arrays(), drafter.cfg
    ctx = fuse_context(p, feats, cfg)
    traces = []

    @jax.jit
    def run(ctx, anchors, keep):
        traces.append(1)
        return backbone_train(p, cfg, tokens, ctx, anchors, keep, gamma=4, mask_id=511)

    anchors = jnp.array([[6, 7, 12], [6, 7, 12]])
    keep = jnp.ones((2, 3), bool)
    h = np.asarray(run(ctx, anchors, keep))
    # context at positions >= p is invisible to the block at p; p-1 is visible
    h2 = np.asarray(run(ctx.at[:, 6:].add(1.0), anchors, keep))
    np.testing.assert_allclose(h2[:, 0], h[:, 0], atol=1e-6)
    assert np.abs(h2[:, 1] - h[:, 1]).max() > 1e-3
    # other blocks never: moving block 2 does not change blocks 0 and 1
    h3 = np.asarray(run(ctx, anchors.at[:, 2].set(9), keep))
    np.testing.assert_allclose(h3[:, :2], h[:, :2], atol=1e-6)
    # dummy rows are finite; kept blocks do not depend on them
    h4 = np.asarray(run(ctx, anchors, keep.at[:, 2].set(False)))
    assert np.isfinite(h4).all()
    np.testing.assert_allclose(h4[:, :2], h[:, :2], atol=1e-6)
    assert np.isfinite(np.asarray(run(ctx, anchors, jnp.zeros_like(keep)))).all()
    assert len(traces) == 1  # new data (context, anchors, keep) never retraces


_JIT_CACHE = {}


def _fns(G, window):
    """Shared jitted train / cache functions per (G, window)."""
    if (G, window) not in _JIT_CACHE:
        def train(p, cfg, tokens, feats, anchors, keep):
            return backbone_train(p, cfg, tokens, fuse_context(p, feats, cfg), anchors, keep,
                                  gamma=G, mask_id=511, window=window)

        def infer(p, cfg, cache, feats, pos, valid, feats2, pos2, valid2, atok, apos):
            cache = update_context(p, cfg, cache, feats, pos, valid)
            cache = update_context(p, cfg, cache, feats2, pos2, valid2)
            return draft_hidden(p, cfg, cache, atok, apos, gamma=G, mask_id=511, window=window), cache.lengths

        _JIT_CACHE[(G, window)] = (jax.jit(train, static_argnums=1), jax.jit(infer, static_argnums=1))
    return _JIT_CACHE[(G, window)]


@pytest.mark.parametrize("G,window,dtype", [(1, None, "float32"), (4, 3, "float32"), (15, None, "float32"),
                                            (7, None, "bfloat16")])
def test_training_and_inference_paths_agree(setup, G, window, dtype):
    drafter, tokens, feats = setup
    dt = jnp.dtype(dtype)
    p, cfg = drafter.arrays(dt), drafter.cfg
    feats = feats.astype(dt)
    B, S = tokens.shape
    anchors = jnp.array([[5, 17], [9, 3]], jnp.int32)
    train, infer = _fns(G, window)
    h_train = train(p, cfg, tokens, feats, anchors, jnp.ones((2, 2), bool))
    # fill the cache in two padded chunks: row 0 gets 10 then 14 tokens, row 1 gets 6 then 18
    T = 20
    cut = np.array([10, 6])
    def chunk(start, n):
        f = np.zeros((B, T, *feats.shape[2:]), np.float32)
        pos = np.zeros((B, T), np.int32)
        valid = np.zeros((B, T), bool)
        for r in range(B):
            f[r, :n[r]] = np.asarray(feats[r, start[r]: start[r] + n[r]], np.float32)
            pos[r] = start[r] + np.arange(T)
            valid[r, :n[r]] = True
        return jnp.asarray(f, dt), jnp.asarray(pos), jnp.asarray(valid)
    c1, c2 = chunk([0, 0], cut), chunk(cut, S - cut)
    cache = drafter.init_cache(B, 32, dt)
    tol = 2e-5 if dtype == "float32" else 6e-2
    for a in range(2):
        apos = anchors[:, a]
        atok = jnp.take_along_axis(tokens, apos[:, None], 1)[:, 0]
        h_inf, lengths = infer(p, cfg, cache, *c1, *c2, atok, apos)
        np.testing.assert_array_equal(np.asarray(lengths), [S, S])
        np.testing.assert_allclose(np.asarray(h_inf, np.float32),
                                   np.asarray(h_train[:, a], np.float32), atol=tol, rtol=tol)
