"""Distribution tests of speculative verification.

Toy setting: a target and a drafter defined by logits tables over all prefixes (V tiny),
both pushed through the SAME `sampling_probs` transform. One round from an empty context:
drafts d_j ~ q(.|d_<j) left to right, target rows p_j = p(.|d_<j), j = 0..G, then
`verify`, then any missing tokens of the first L = 3 are sampled from the target. The law
of those 3 tokens must equal the target's p(x1) p(x2|x1) p(x3|x1 x2) for every length
0..G (one batch row per length).

Exact test: numpy enumeration (tests/_reference.verify_law) vs target law, atol 1e-6.
Monte-Carlo test: N = 200,000 keys through jax.vmap(verify); Pearson chi-square of the
joint counts (cells with expected < 5 pooled) at alpha = 1e-3 against the exact target
law. Power: the noncentrality is >= N * 4 * TV^2 (Cauchy-Schwarz), i.e. >= 80 at TV =
0.01; with <= 63 degrees of freedom the critical value is <= 103.4, so the power to
detect TV = 0.01 is >= 0.97 (noncentral chi-square, mean >= 143, sd ~21).
The broken variants (a) "sample the correction from p" and (b) "verify against the
unfiltered q" are shown to differ exactly (TV > 0.01) and to be rejected by the same test.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.rejection import residual_distribution, verify
from dspark_jax.decoding.sampling import sample, sampling_probs
from tests._reference import all_seqs, chi2_test, extend_with_target, target_law, verify_law

L = 3
N_MC = 200_000
ALPHA = 1e-3


def _code(prefix, V):
    return sum((t + 1) * (V + 1) ** i for i, t in enumerate(prefix))


def make_setting(seed, V, G, temperature, top_k, top_p):
    rng = np.random.default_rng(seed)
    n = (V + 1) ** max(G, L)
    t_logits = rng.normal(0, 1.5, (n, V)).astype(np.float32)
    d_logits = (t_logits + rng.normal(0, 1.0, (n, V))).astype(np.float32)
    P = sampling_probs(jnp.asarray(t_logits), temperature, top_k, top_p)
    Q = sampling_probs(jnp.asarray(d_logits), temperature, top_k, top_p)
    Q_raw = sampling_probs(jnp.asarray(d_logits), temperature, 0, 1.0)  # not filtered
    return dict(V=V, G=G, P=P, Q=Q, Q_raw=Q_raw)


def _np_rows(T):
    T = np.asarray(T, np.float64)
    return T / T.sum(-1, keepdims=True)


def exact_law(s, length, variant="ok"):
    V, G = s["V"], s["G"]
    P, Q, Qr = _np_rows(s["P"]), _np_rows(s["Q"]), _np_rows(s["Q_raw"])
    cond = lambda pre: P[_code(pre, V)]
    law = np.zeros((V,) * L)
    for d in all_seqs(V, G):
        pq = np.prod([Q[_code(d[:j], V)][d[j]] for j in range(G)])
        if pq == 0:
            continue
        q_rows = [Q[_code(d[:j], V)] for j in range(G)]
        qv = [Qr[_code(d[:j], V)] for j in range(G)] if variant == "unfiltered_q" else None
        p_rows = [P[_code(d[:j], V)] for j in range(G + 1)]
        for pr, out in verify_law(d, q_rows, p_rows, length, qv, residual=(variant != "no_residual")):
            for pr2, t in extend_with_target(out, L, cond):
                law[t] += pq * pr * pr2
    return law


def broken_verify_no_residual(key, d, q, p, lengths):
    """Broken variant (a): at the first rejection sample from p_j instead of the residual."""
    R, G = d.shape
    k_u, k_s = jax.random.split(key)
    pd = jnp.take_along_axis(p[:, :G], d[..., None], -1)[..., 0]
    qd = jnp.take_along_axis(q, d[..., None], -1)[..., 0]
    acc_m = (jax.random.uniform(k_u, (R, G)) * qd < pd) & (jnp.arange(G)[None] < lengths[:, None])
    acc = jnp.sum(jnp.cumprod(acc_m.astype(jnp.int32), 1), 1)
    last = sample(k_s, p[jnp.arange(R), acc])
    pos = jnp.arange(G + 1)[None]
    dext = jnp.concatenate([d, jnp.zeros((R, 1), d.dtype)], 1)
    out = jnp.where(pos < acc[:, None], dext, jnp.where(pos == acc[:, None], last[:, None], -1))
    return acc, out, acc + 1


@partial(jax.jit, static_argnames=("V", "G"))
def mc_first_tokens(keys, P, Q, Q_verify, V, G, broken_a=False):
    """Cell index (base V) of the first L tokens for each key and each row (length = row)."""
    R = G + 1
    lengths = jnp.arange(R, dtype=jnp.int32)

    def one(key):
        kd, kv, kf = jax.random.split(key, 3)
        kds = jax.random.split(kd, G)
        code = jnp.zeros((R,), jnp.int32)
        ds, qs, qvs, ps = [], [], [], []
        for j in range(G):
            qj = Q[code]
            dj = sample(kds[j], qj)
            ds.append(dj); qs.append(qj); qvs.append(Q_verify[code]); ps.append(P[code])
            code = code + (dj + 1) * (V + 1) ** j
        ps.append(P[code])
        d, qv, p = jnp.stack(ds, 1), jnp.stack(qvs, 1), jnp.stack(ps, 1)
        # broken_a is traced (one compiled program per shape): run both, select.
        _, out, n_out = verify(kv, d, qv, p, lengths)
        _, out_a, n_a = broken_verify_no_residual(kv, d, qv, p, lengths)
        out = jnp.where(broken_a, out_a, out)
        n_out = jnp.where(broken_a, n_a, n_out)
        kfs = jax.random.split(kf, L)
        code = jnp.zeros((R,), jnp.int32)
        cell = jnp.zeros((R,), jnp.int32)
        for i in range(L):
            tok = jnp.where(i < n_out, out[:, i], sample(kfs[i], P[code]))
            code = code + (tok + 1) * (V + 1) ** i
            cell = cell * V + tok
        return cell

    return jax.vmap(one)(keys)


SETTINGS = {
    "T1_V4_G3": dict(seed=1, V=4, G=3, temperature=1.0, top_k=0, top_p=1.0),
    "T07_p08_k4_V6_G2": dict(seed=2, V=6, G=2, temperature=0.7, top_k=4, top_p=0.8),
}


@pytest.fixture(scope="module", params=list(SETTINGS))
def setting(request):
    return make_setting(**SETTINGS[request.param])


def _target(s):
    P = _np_rows(s["P"])
    return target_law(L, s["V"], lambda pre: P[_code(pre, s["V"])])


def _tv(a, b):
    return 0.5 * np.abs(a - b).sum()


def test_exact_enumeration_correct_and_broken(setting):
    s, tgt = setting, _target(setting)
    for length in range(s["G"] + 1):
        np.testing.assert_allclose(exact_law(s, length), tgt, atol=1e-6)
    assert _tv(exact_law(s, s["G"], "no_residual"), tgt) > 0.01
    if s["V"] == 6:  # truncation active: verifying against the unfiltered q is wrong
        assert _tv(exact_law(s, s["G"], "unfiltered_q"), tgt) > 0.01


def _pvals(cells, tgt):
    return [chi2_test(np.bincount(cells[:, r], minlength=tgt.size), tgt)[2] for r in range(cells.shape[1])]


def test_monte_carlo_chi_square(setting):
    s, tgt = setting, _target(setting)
    keys = jax.random.split(jax.random.PRNGKey(7), N_MC)
    cells = np.asarray(mc_first_tokens(keys, s["P"], s["Q"], s["Q"], s["V"], s["G"]))
    pv = _pvals(cells, tgt)
    assert min(pv) > ALPHA, pv
    cells_a = np.asarray(mc_first_tokens(keys, s["P"], s["Q"], s["Q"], s["V"], s["G"], broken_a=True))
    assert _pvals(cells_a, tgt)[-1] < ALPHA  # full-length row
    if s["V"] == 6:
        cells_b = np.asarray(mc_first_tokens(keys, s["P"], s["Q"], s["Q_raw"], s["V"], s["G"]))
        assert _pvals(cells_b, tgt)[-1] < ALPHA


def test_greedy_one_hot_follows_target_argmax():
    s = make_setting(seed=3, V=4, G=3, temperature=0.0, top_k=0, top_p=1.0)
    keys = jax.random.split(jax.random.PRNGKey(0), N_MC)  # same shapes as the MC test: no recompile
    cells = np.asarray(mc_first_tokens(keys, s["P"], s["Q"], s["Q"], 4, 3))
    tgt = _target(s)
    assert tgt.max() == 1.0
    assert np.all(cells == int(np.argmax(tgt.ravel())))


verify_jit = jax.jit(verify, static_argnames=("eos_id", "pad_id"))


def test_mechanics_and_eos():
    V, E = 6, 5
    oh = lambda ids: jax.nn.one_hot(jnp.asarray(ids), V)
    # row0: all accepted -> bonus; row1: reject at 1 -> correction = target argmax;
    # row2: EOS accepted at slot 1 -> stop, no bonus; row3: correction is EOS;
    # row4: length 1, EOS draft beyond the verified prefix is ignored; row5: bonus is EOS.
    d = jnp.asarray([[1, 2, 3], [1, 2, 3], [1, E, 3], [1, 2, 3], [1, E, E], [1, 2, 3]])
    q = oh(d)
    p = oh([[1, 2, 3, 4], [1, 0, 3, 4], [1, E, 3, 4], [E, 2, 3, 4], [1, E, E, 2], [1, 2, 3, E]])
    lengths = jnp.asarray([3, 3, 3, 3, 1, 3])
    for k in range(3):
        acc, out, n = verify_jit(jax.random.PRNGKey(k), d, q, p, lengths, eos_id=E)
        assert acc.tolist() == [3, 1, 2, 0, 1, 3]
        assert n.tolist() == [4, 2, 2, 1, 2, 4]
        assert out.tolist() == [[1, 2, 3, 4], [1, 0, -1, -1], [1, E, -1, -1], [E, -1, -1, -1],
                                [1, E, -1, -1], [1, 2, 3, E]]
    # without eos_id the EOS draft is just a token
    acc, out, n = verify_jit(jax.random.PRNGKey(0), d, q, p, lengths)
    assert acc[2] == 3 and n[2] == 4 and out[2].tolist() == [1, E, 3, 4]
    # residual: no mass -> p
    np.testing.assert_allclose(residual_distribution(jnp.asarray([0.5, 0.5]), jnp.asarray([0.5, 0.5])), [0.5, 0.5])
    np.testing.assert_allclose(residual_distribution(jnp.asarray([0.7, 0.3]), jnp.asarray([0.5, 0.5])),
                               [0.2, 0.0], atol=1e-7)


def test_packed_probabilities_give_the_same_verification():
    """The engine hands `verify` its target rows packed (`PackedProbs`: request r's row j at
    `packed[dest[r, j]]`, rows in any order, padding rows beside them): the result is the one
    of the gathered `[R, G+1, V]` array, bit for bit, for every key and length, sampled and
    greedy. A `dest` read off by one row (the bonus row of the previous slot) differs."""
    from dspark_jax.decoding.rejection import PackedProbs

    rng = np.random.default_rng(3)
    R, G, V, B = 5, 4, 7, 40
    for greedy in (False, True):
        logits = rng.normal(size=(B, V)).astype(np.float32) * 2
        packed = np.asarray(sampling_probs(jnp.asarray(logits), 0.0 if greedy else 1.0, 0, 1.0))
        dest = rng.permutation(B)[: R * (G + 1)].reshape(R, G + 1).astype(np.int32)
        q = np.asarray(sampling_probs(jnp.asarray(rng.normal(size=(R, G, V)).astype(np.float32)), 1.0, 0, 1.0))
        lengths = jnp.asarray([0, 1, 2, 4, 3], jnp.int32)
        p = jnp.asarray(packed[dest])
        for i in range(20):
            key = jax.random.key(i)
            drafts = jnp.asarray(rng.integers(0, V, (R, G)), jnp.int32)
            got = verify(key, drafts, jnp.asarray(q), PackedProbs(jnp.asarray(packed), jnp.asarray(dest)), lengths)
            want = verify(key, drafts, jnp.asarray(q), p, lengths)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    shifted = np.roll(dest.reshape(-1), 1).reshape(R, G + 1)
    outs = [np.asarray(verify(jax.random.key(i), drafts, jnp.asarray(q), PackedProbs(jnp.asarray(packed),
                                                                                 jnp.asarray(shifted)), lengths)[1])
            for i in range(20)]
    ref = [np.asarray(verify(jax.random.key(i), drafts, jnp.asarray(q), p, lengths)[1]) for i in range(20)]
    assert any((a != b).any() for a, b in zip(outs, ref))
