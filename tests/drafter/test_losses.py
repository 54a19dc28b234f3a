import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.drafter.losses import LossCoefs, bce_with_logits, combine, dspark_loss_sums, soft_label


def _np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_loss(logits, tlogits, labels, valid, z, coefs=(0.1, 0.9, 1.0), decay=4.0):
    g = logits.shape[-2]
    w = np.exp(-np.arange(g) / decay) * valid
    q, p = _np_softmax(logits), _np_softmax(tlogits)
    ce = -np.log(np.take_along_axis(q, labels[..., None], -1)[..., 0])
    l1 = np.abs(q - p).sum(-1)
    c = np.clip(1 - 0.5 * l1, 0, 1)
    sig = 1 / (1 + np.exp(-z))
    bce = -(c * np.log(sig) + (1 - c) * np.log(1 - sig))
    den = w.sum()
    return coefs[0] * (w * ce).sum() / den + coefs[1] * (w * l1).sum() / den + coefs[2] * (w * bce).sum() / den


def test_loss_matches_numpy_reference():
    rng = np.random.default_rng(0)
    shape = (2, 3, 5)
    logits = rng.normal(size=shape + (11,)) * 2
    tlogits = rng.normal(size=shape + (11,)) * 2
    labels = rng.integers(0, 11, shape)
    valid = np.cumprod(rng.random(shape) < 0.8, -1).astype(bool)
    z = rng.normal(size=shape)
    sums = dspark_loss_sums(jnp.asarray(logits), jnp.asarray(tlogits), jnp.asarray(labels),
                            jnp.asarray(valid), jnp.asarray(z))
    total, parts = combine(sums, LossCoefs())
    np.testing.assert_allclose(float(total), reference_loss(logits, tlogits, labels, valid, z), rtol=1e-5)
    # a wrong decay constant (the paper's exp(-j/gamma)) gives a different number
    assert abs(reference_loss(logits, tlogits, labels, valid, z, decay=5.0) - float(total)) > 1e-4


def test_soft_label_is_acceptance_rate_and_detached():
    q = jnp.array([0.5, 0.5, 0.0])
    p = jnp.array([0.7, 0.3, 0.0])
    # acceptance rate of rejection sampling = sum min(p, q) = 0.8
    np.testing.assert_allclose(soft_label(q, p), 0.8, rtol=1e-6)
    g = jax.grad(lambda q: soft_label(q, p))(q)
    assert np.all(np.asarray(g) == 0)


def test_bce_stable_for_large_logits():
    z = jnp.array([-100.0, 0.0, 100.0])
    t = jnp.array([0.0, 0.5, 1.0])
    np.testing.assert_allclose(bce_with_logits(z, t), [0.0, np.log(2), 0.0], atol=1e-6)


def test_gradient_of_confidence_loss_reaches_logits_only_through_z():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(1, 4, 7)))
    tl = jnp.asarray(rng.normal(size=(1, 4, 7)))
    labels = jnp.zeros((1, 4), jnp.int32)
    valid = jnp.ones((1, 4), bool)
    z = jnp.zeros((1, 4))
    only_conf = LossCoefs(ce=0.0, l1=0.0, conf=1.0)
    g_logits, g_z = jax.grad(lambda l, z: combine(dspark_loss_sums(l, tl, labels, valid, z), only_conf)[0],
                             argnums=(0, 1))(logits, z)
    assert np.all(np.asarray(g_logits) == 0) and np.any(np.asarray(g_z) != 0)


def test_top1_statistics_match_numpy_argmax():
    """`correct` (label == argmax q, read from the log-softmax row max) and the per-slot counts
    equal numpy's argmax, and labels set to the argmax are all counted."""
    rng = np.random.default_rng(3)
    shape = (3, 4, 6)
    logits = rng.normal(size=shape + (13,)) * 3
    labels = rng.integers(0, 13, shape)
    labels[0] = np.argmax(logits[0], -1)  # one row of blocks exactly right
    valid = np.cumprod(rng.random(shape) < 0.9, -1).astype(bool)
    sums = dspark_loss_sums(jnp.asarray(logits), jnp.asarray(logits), jnp.asarray(labels), jnp.asarray(valid))
    want = (valid & (np.argmax(logits, -1) == labels)).sum(axis=(0, 1))
    np.testing.assert_array_equal(np.asarray(sums.correct), want)
    assert want.sum() >= valid[0].sum()  # the exact row is counted whole
