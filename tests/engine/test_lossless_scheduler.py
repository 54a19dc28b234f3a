"""Losslessness of the engine's compiled round with each prefix scheduler (docs/method.md §3, issue 7).

Instance: R = 3 requests, gamma 2, vocabulary 2, temperature 1. The DSpark drafter's
confidence logit of slot 1 reads the sampled slot-0 token (its Markov embedding), so the
survival a[r, 1] -- and through the schedulers' order, whether slot 0 is verified at all --
depends on d_0; the target's next-token law differs across first tokens. The throughput
objective is the paper's `tau * SPS(B)` on an accelerator-shaped table, so the schedulers
admit some draft tokens and not others depending on the drafts.

Statistic per instance: for every request, the first output token x1 and the second x2
(from the round if it emitted two tokens, else drawn from the target given x1, the
continuation a lossless engine must have); 4^3 = 64 joint cells over the three requests.

* Exact: the joint law of the round, enumerated over all (V^G)^R = 64 draft combinations
  with the numpy schedulers and exact rejection-sampling algebra on the model's own q, z
  and p tables, equals the target's law (to 1e-6: float32 tables) for early-stop, static-shape and production;
  the retroactive (argmax over all prefix throughputs) variant's law is 0.024 away in total variation.
* Monte Carlo: N = 1e5 instances of the compiled engine round (vmapped keys), Pearson
  chi-square against the target's law at alpha = 1e-4 (df = 63). Power: the noncentrality
  of the retroactive variant, N * sum((p_retro - p)^2 / p) from the enumeration, is asserted
  to give power >= 0.99 at that alpha; the compiled retroactive round must be rejected.
* Rounds: early-stop, static-shape and retroactive are tested on the first round after
  prefill; production on the THIRD round the engine runs (two warm-up rounds with a fixed
  key), so its capacity comes from the stale survivals of round 1, not the default.
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dspark_jax.decoding.sampling import SamplingParams, sampling_probs
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.round import draft, round_step
from dspark_jax.scheduler import prefix as scheduler
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
from tests import broken
from tests.scheduler import prefix_reference as numpy_ref

V, G, R = 2, 2, 3
N, CHUNK = 100_000, 50_000  # the retroactive variant's noncentrality at this N: about 363 (power ~1)
ALPHA = 1e-4
PROMPTS = [[0, 1, 1], [1, 0], [1, 1, 0, 1]]
T1 = SamplingParams(1.0, 0, 1.0)
BUCKETS = (3, 6, 9)
# The engine compiles one verification bucket here: vmapped over instances, the round's bucket
# `lax.switch` would run every branch (2x the time). The schedulers still decide on the table's
# buckets (3, 6, 9) from the traced Control; the bucket dispatch is tested in test_engine_scheduler.
ENGINE_BUCKETS = (9,)
CONCAVE = (1.0, 1.5, 1.6)  # seconds per bucket: a dip at the first admitted token, then cheap tokens
STEEP = (1.0, 1.5, 3.0)  # production: the stale capacity lands inside the second bucket, so top-K decides
STS = (1.0, 1.0)
WARM_KEY = 100  # after two rounds the anchors are (0, 1, 1): the stale capacity K = 3 cuts between drafts


def retroactive(a, active, ctl, a_stale, stale_valid):
    """The lossy variant (tests/broken.py's schedule_retroactive_lossy) as an engine policy."""
    return broken.schedule_retroactive_lossy(a, active, ctl.table, mode="sps", cost="interp")


VARIANTS = {  # name -> (engine policy, warm-up rounds before the tested round, verification times)
    "early_stop": ("early_stop", 0, CONCAVE),
    "static": ("static", 0, CONCAVE),
    "production": ("production", 2, STEEP),
    "retroactive": (retroactive, 0, CONCAVE),
}


def table(name, as_numpy=False):
    return scheduler.make_table(BUCKETS, t_verify=VARIANTS[name][2], t_draft=0.3, as_numpy=as_numpy)


def numpy_lengths(name, a, a_stale, stale_valid, default_k):
    active = np.ones(R, bool)
    tab = table(name, as_numpy=True)
    if name == "early_stop":
        return numpy_ref.schedule_early_stop_np(a, active, tab, mode="sps", cost="interp")
    if name == "static":
        return numpy_ref.schedule_static_np(a, active, tab, mode="sps")[0]
    if name == "production":
        return numpy_ref.schedule_production_np(a, active, a_stale, stale_valid, tab, default_k,
                                                mode="sps", cost="interp")[0]
    return numpy_ref.schedule_retroactive_lossy_np(a, active, tab, mode="sps", cost="interp")


# ------------------------------------------------------------------ models and engines


C_PREV = (0.3, 0.8)  # designed c_j = sigmoid(z_j) given the previous token 0 / 1


@pytest.fixture(scope="module")
def models():
    """Tiny target; DSpark drafter whose confidence reads only the previous token's Markov
    embedding, z_j = logit(C_PREV[prev]) (h-part zeroed): slot 0's survival follows the
    anchor, slot 1's follows d_0, so admitting slot 0 can hinge on d_0 through a_1."""
    target = tiny_target(tiny_config(vocab_size=V, hidden_size=16, num_layers=2), logit_scale=1.5)
    d = tiny_drafter("dspark", target, gamma=G, markov_scale=3.0)
    H = target.cfg.hidden_size
    w1 = np.asarray(d.markov_w1[...], np.float64)  # [V, r]
    zt = np.log(np.asarray(C_PREV) / (1 - np.asarray(C_PREV)))
    k = np.zeros((H + w1.shape[1], 1))
    k[H:, 0] = np.linalg.pinv(w1) @ zt
    d.conf_kernel.set_value(jnp.asarray(k, jnp.float32))
    d.conf_bias.set_value(jnp.zeros((1,), jnp.float32))
    return target, d


_ENGINES: dict = {}


def engine(models, name):
    if name not in _ENGINES:
        target, d = models
        policy = VARIANTS[name][0]
        _ENGINES[name] = Engine(target, d, EngineConfig(num_slots=R, max_len=16, buckets=ENGINE_BUCKETS,
                                                        prefill_buckets=(8,), policy=policy,
                                                        theta="sps", cost="interp"))
    return _ENGINES[name]


def control(eng, name):
    return eng.control(T1, table=table(name), sts=STS, default_k=R * G)


def start_state(eng, name, warm_rounds):
    """Prefilled state after `warm_rounds` rounds with a fixed key (the same for every instance)."""
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(WARM_KEY), R)))
    st = eng.prefill_slots(eng.init_state(), list(range(R)), PROMPTS, kd, [12] * R)
    ctl = control(eng, name)
    for _ in range(warm_rounds):
        st, _ = eng.step(st, ctl)
    return st


def committed(st):
    """Per request: the token sequence the target has committed (prompt + generated)."""
    out, n = np.asarray(st.out), np.asarray(st.n_gen)
    return [PROMPTS[r] + out[r, : n[r]].tolist() for r in range(R)]


# ------------------------------------------------------------------ exact tables


def target_next(target, seqs):
    """Exact next-token law (temperature 1) after each sequence."""
    return [np.asarray(sampling_probs(target(jnp.asarray([s])).logits[0, -1], *T1), np.float64) for s in seqs]


def target_tables(target, prefixes):
    """p0[r] = p(.|prefix), p1[r][x] = p(.|prefix, x), p2[r][x][y] = p(.|prefix, x, y)."""
    p0 = target_next(target, prefixes)
    p1 = [target_next(target, [pf + [x] for x in range(V)]) for pf in prefixes]
    return np.stack(p0), np.asarray(p1)


def drafter_tables(eng, st, n_keys=512):
    """q0 [R, V], z0 [R], q1 [R, V(d0), V], z1 [R, V(d0)] from the engine's own draft function
    (deterministic given d_0; every d_0 value must be observed)."""
    spec, dp = eng.spec, eng.dp
    samp = jax.tree.map(lambda x: jnp.broadcast_to(x, (R,)), T1)

    @jax.jit
    def many(keys):
        return jax.vmap(lambda k: draft(spec, dp, st, k, samp)[:3])(keys)

    keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(jax.random.key(7), i), R))(jnp.arange(n_keys))
    toks, q, z = (np.asarray(x, np.float64) for x in many(keys))
    toks = toks.astype(np.int64)
    q = q / q.sum(axis=-1, keepdims=True)  # float32 rounding
    q0, z0 = q[0, :, 0], z[0, :, 0]
    q1, z1 = np.zeros((R, V, V)), np.zeros((R, V))
    for r in range(R):
        np.testing.assert_allclose(q[:, r, 0], np.broadcast_to(q0[r], (n_keys, V)), atol=1e-6)
        for x in range(V):
            sel = toks[:, r, 0] == x
            assert sel.any(), f"draft value {x} never drawn at slot 0 of request {r}"
            np.testing.assert_allclose(q[sel, r, 1], np.broadcast_to(q[sel, r, 1][0], (sel.sum(), V)), atol=1e-6)
            q1[r, x], z1[r, x] = q[sel, r, 1][0], z[sel, r, 1][0]
    return q0, z0, q1, z1


# ------------------------------------------------------------------ exact law by enumeration


def _residual(p, q):
    res = np.maximum(p - q, 0.0)
    return res / res.sum() if res.sum() > 0 else p


def row_law(p0, p1, q0, q1, d, l):
    """Exact law [V, V] of (x1, x2) of one request whose drafts d = (d0, d1) are verified up to l."""
    out = p0[:, None] * p1 if l == 0 else np.zeros((V, V))
    if l == 0:
        return out
    d0, d1 = d
    acc0 = min(1.0, p0[d0] / q0[d0])
    out += (1 - acc0) * _residual(p0, q0)[:, None] * p1
    if l == 1:
        out[d0] += acc0 * p1[d0]  # accepted d0, bonus from p(.|d0)
    else:
        acc1 = min(1.0, p1[d0][d1] / q1[d0][d1])
        out[d0, d1] += acc0 * acc1
        out[d0] += acc0 * (1 - acc1) * _residual(p1[d0], q1[d0])
    return out


def enumerate_round(name, tabs, a_stale, stale_valid, default_k):
    """(joint law [V,V]*R, lengths per combination [64, R], combination probabilities)."""
    p0, p1, q0, z0, q1, z1 = tabs
    law = np.zeros((V, V) * R)
    all_l, probs = [], []
    for d in itertools.product(itertools.product(range(V), repeat=G), repeat=R):
        prob = np.prod([q0[r, d[r][0]] * q1[r, d[r][0], d[r][1]] for r in range(R)])
        z = np.asarray([[z0[r], z1[r, d[r][0]]] for r in range(R)])
        a = numpy_ref.prefix_survival_np(z, STS)
        l = numpy_lengths(name, a, a_stale, stale_valid, default_k)
        term = prob
        for r in range(R):
            term = np.multiply.outer(term, row_law(p0[r], p1[r], q0[r], q1[r], d[r], l[r]))
        law += term
        all_l.append(l)
        probs.append(prob)
    return law, np.asarray(all_l), np.asarray(probs)


def target_law(p0, p1):
    law = np.ones(())
    for r in range(R):
        law = np.multiply.outer(law, p0[r][:, None] * p1[r])
    return law


# ------------------------------------------------------------------ Monte Carlo on the compiled round


def sample_round(eng, st, ctl, p1, n=N, seed=0):
    """Counts [V,V]*R of (x1, x2) per request over n vmapped instances of the compiled round."""
    n0 = np.asarray(st.n_gen)
    vround = jax.jit(jax.vmap(functools.partial(round_step, eng.spec), in_axes=(None, None, 0, None)))
    rng = np.random.default_rng(seed)
    counts = np.zeros((V * V) ** R, np.int64)
    for c0 in range(0, n, CHUNK):
        m = min(CHUNK, n - c0)
        keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(jax.random.key(seed), i), R))(
            jnp.arange(c0, c0 + m))
        stb = jax.tree.map(lambda x: jnp.broadcast_to(x, (m, *x.shape)), st._replace(keys=None))._replace(keys=keys)
        new, _ = vround(eng.tp, eng.dp, stb, ctl)
        out, ng = np.asarray(new.out), np.asarray(new.n_gen)
        cell = np.zeros(m, np.int64)
        for r in range(R):
            x1 = out[:, r, n0[r]]
            emitted2 = ng[:, r] - n0[r] >= 2
            u = rng.random(m)
            fresh = (u[:, None] > np.cumsum(p1[r][x1], axis=1)).sum(axis=1)  # x2 ~ p(.|x1)
            x2 = np.where(emitted2, out[:, r, n0[r] + 1], fresh)
            cell = cell * (V * V) + x1 * V + x2
        counts += np.bincount(cell, minlength=(V * V) ** R)
    return counts


def chi2(counts, probs):
    p, c = probs.ravel(), counts.ravel()
    exp = p * c.sum()
    return float(stats.chi2.sf(np.sum((c - exp) ** 2 / exp), p.size - 1))


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module")
def cases(models):
    """Per variant: engine, tested state, control, exact tables, enumerated and target laws."""
    target, _ = models
    out = {}
    for name, (_, warm, _) in VARIANTS.items():
        eng = engine(models, name)
        st = start_state(eng, name, warm)
        p0, p1 = target_tables(target, committed(st))
        q0, z0, q1, z1 = drafter_tables(eng, st)
        stale = np.asarray(st.a_hist[1], np.float64)
        stale_valid = int(st.step) >= 2
        ctl = control(eng, name)
        law, lengths, probs = enumerate_round(name, (p0, p1, q0, z0, q1, z1), stale, stale_valid, int(ctl.default_k))
        out[name] = dict(eng=eng, st=st, ctl=ctl, p1=p1, law=law, target=target_law(p0, p1), lengths=lengths,
                         probs=probs, stale_valid=stale_valid, z1=z1, p1_tab=p1)
    return out


def test_instance_is_informative(cases):
    """The instance exercises what can go wrong: first-token-dependent target and confidence,
    admissions that vary with the drafts, and (production) a capacity from stale survivals."""
    c = cases["early_stop"]
    p1 = c["p1_tab"]
    assert max(np.abs(p1[r][0] - p1[r][1]).sum() for r in range(R)) > 0.2  # target depends on x1
    assert min(abs(c["z1"][r][0] - c["z1"][r][1]) for r in range(R)) > 0.3  # z_1 depends on d_0
    for name in VARIANTS:
        l, pr = cases[name]["lengths"], cases[name]["probs"]
        admitted = (pr[:, None] * (l > 0)).sum(axis=0)
        assert admitted.max() > 0.05, f"{name}: no draft token is ever verified"
        assert len({tuple(x) for x in l}) > 1, f"{name}: lengths never depend on the drafts"
    assert cases["production"]["stale_valid"]


@pytest.mark.parametrize("name", ["early_stop", "static", "production"])
def test_enumerated_law_is_the_target(cases, name):
    np.testing.assert_allclose(cases[name]["law"], cases[name]["target"], atol=1e-6)  # float32 q, p


def test_retroactive_law_differs_with_power(cases):
    c = cases["retroactive"]
    law, tgt = c["law"], c["target"]
    assert abs(law.sum() - 1) < 1e-6
    lam = N * float(np.sum((law - tgt) ** 2 / tgt))
    df = tgt.size - 1
    power = stats.ncx2.sf(stats.chi2.isf(ALPHA, df), df, lam)
    assert power >= 0.99, f"instance too weak to expose the retroactive scheduler: power {power:.3f} (lambda {lam:.1f})"


@pytest.mark.parametrize("name", ["early_stop", "static", "production"])
def test_compiled_round_is_lossless(cases, name):
    c = cases[name]
    counts = sample_round(c["eng"], c["st"], c["ctl"], c["p1"])
    pv = chi2(counts, c["target"])
    assert pv > ALPHA, f"{name}: p-value {pv:.2e}"


def test_compiled_retroactive_round_fails(cases):
    c = cases["retroactive"]
    pv = chi2(sample_round(c["eng"], c["st"], c["ctl"], c["p1"]), c["target"])
    assert pv < ALPHA, f"the retroactive scheduler's bias went undetected (p-value {pv:.3f})"
