import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams, probs_from_params, sample, sampling_probs
from tests._reference import chi2_test, ref_sampling_probs

_TRACES = {"n": 0}


def _probs_fn(logits, params):
    _TRACES["n"] += 1
    return probs_from_params(logits, params)


probs_jit = jax.jit(_probs_fn)
sample_jit = jax.jit(sample)


def _ref_rows(logits, t, k, p):
    return np.stack([ref_sampling_probs(logits[i], t[i], k[i], p[i]) for i in range(len(logits))])


def test_matches_reference_per_row_params_with_ties():
    rng = np.random.default_rng(0)
    V, N = 12, 256
    # integer logits => many exact ties; a few huge gaps
    logits = rng.integers(-3, 4, size=(N, V)).astype(np.float32)
    t = rng.choice([0.0, -1.0, 0.3, 0.7, 1.0, 2.0], N).astype(np.float32)
    k = rng.choice([0, -1, 1, 2, 3, 5, 11, 12, 20], N).astype(np.int32)
    p = rng.choice([1.0, 1.5, 0.0, 0.1, 0.5, 0.8, 0.95], N).astype(np.float32)
    got = np.asarray(probs_jit(jnp.asarray(logits), SamplingParams(jnp.asarray(t), jnp.asarray(k), jnp.asarray(p))))
    ref = _ref_rows(logits, t, k, p)
    np.testing.assert_allclose(got, ref, atol=2e-6)
    # scalar params and leading batch dims, traced: no retrace for new values
    n0 = _TRACES["n"]
    lg = jnp.asarray(logits.reshape(16, 16, V))
    for (tt, kk, pp) in [(0.7, 20, 0.8), (1.3, 3, 0.6)]:
        got = np.asarray(probs_jit(lg, SamplingParams(jnp.float32(tt), jnp.int32(kk), jnp.float32(pp))))
        ref = _ref_rows(logits, [tt] * N, [kk] * N, [pp] * N).reshape(16, 16, V)
        np.testing.assert_allclose(got, ref, atol=2e-6)
    assert _TRACES["n"] - n0 <= 1


def test_top_k_ties_keep_lower_index_and_top_p_boundaries():
    lg = jnp.asarray([[1.0, 2.0, 2.0, 2.0, 0.0]])
    pr = np.asarray(sampling_probs(lg, 1.0, 2, 1.0))[0]
    assert (pr > 0).tolist() == [False, True, True, False, False]
    np.testing.assert_allclose(pr[1:3], [0.5, 0.5], atol=1e-6)
    lg = jnp.log(jnp.asarray([[0.125, 0.5, 0.25, 0.125]]))
    assert (np.asarray(sampling_probs(lg, 1.0, 0, 0.74))[0] > 0).tolist() == [False, True, True, False]
    assert (np.asarray(sampling_probs(lg, 1.0, 0, 0.76))[0] > 0).tolist() == [True, True, True, False]
    assert (np.asarray(sampling_probs(lg, 1.0, 0, 0.3))[0] > 0).tolist() == [False, True, False, False]
    assert (np.asarray(sampling_probs(lg, 1.0, 0, 0.0))[0] > 0).tolist() == [False, True, False, False]
    np.testing.assert_allclose(np.asarray(sampling_probs(lg, 1.0, 0, 1.0))[0], [0.125, 0.5, 0.25, 0.125], atol=1e-6)
    # greedy: first index on ties, independent of top-k/top-p
    g = np.asarray(sampling_probs(jnp.asarray([[0.0, 3.0, 3.0]]), 0.0, 1, 0.1))[0]
    assert g.tolist() == [0.0, 1.0, 0.0]


def test_sample_exact_distribution_and_greedy_determinism():
    V, N = 8, 200_000
    probs = jnp.asarray(ref_sampling_probs(np.linspace(-1, 1.5, V) ** 2, 1.0, 6, 0.97), jnp.float32)
    toks = np.asarray(sample_jit(jax.random.PRNGKey(1), jnp.broadcast_to(probs, (N, V))))
    counts = np.bincount(toks, minlength=V)
    _, _, pval = chi2_test(counts, np.asarray(probs))
    assert pval > 1e-3
    # a wrong sampler (uniform over the support) is rejected at this N
    wrong = np.asarray(probs) > 0
    _, _, pval_w = chi2_test(counts, wrong / wrong.sum())
    assert pval_w < 1e-3
    one_hot = jax.nn.one_hot(jnp.asarray([3, 0, 7]), V)
    for s in range(5):
        assert np.asarray(sample_jit(jax.random.PRNGKey(s), one_hot)).tolist() == [3, 0, 7]


@pytest.mark.parametrize("k, p", [(0, 1.0), (3, 1.0), (20, 0.8), (64, 0.9), (65, 0.9), (0, 0.6), (300, 0.95)])
def test_each_fast_path_matches_reference(k, p):
    """Uniform settings take the no-sort, top_k (<= TOPK_CAP) or full-sort path; all equal the reference."""
    from tests._reference import ref_sampling_probs

    rng = np.random.default_rng(k)
    logits = np.round(rng.normal(size=(32, 300)) * 2) / 2  # many exact ties
    got = np.asarray(sampling_probs(jnp.asarray(logits, jnp.float32), 0.7, k, p))
    want = np.stack([ref_sampling_probs(row, 0.7, k, p) for row in logits])
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_batch_path_keeps_one_branch_under_per_row_vmap():
    """Under a per-row vmap the path index is batched and `lax.switch` becomes a select over all
    three paths (the full sort included); a batch-level `sampling_path` keeps a real switch with
    the same probabilities."""
    from dspark_jax.decoding.sampling import sampling_path

    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(4, 50)), jnp.float32)
    t, k, p = jnp.asarray([1.0, 0.7, 1.0, 0.5]), jnp.asarray([0, 0, 0, 0]), jnp.asarray([1.0, 1.0, 1.0, 1.0])

    def per_row(path):
        return jax.vmap(lambda lg, t_, k_, p_: sampling_probs(lg, t_, k_, p_, path=path))

    def batched_path(lg, t_, k_, p_):
        return per_row(sampling_path(t_, k_, p_, lg.shape[-1]))(lg, t_, k_, p_)

    assert "cond[" not in str(jax.make_jaxpr(per_row(None))(logits, t, k, p))  # the problem
    assert "cond[" in str(jax.make_jaxpr(batched_path)(logits, t, k, p))
    np.testing.assert_allclose(batched_path(logits, t, k, p), sampling_probs(logits, t, k, p), atol=1e-6)
    assert int(sampling_path(t, k, p, 50)) == 0
    assert int(sampling_path(t, jnp.asarray([0, 5, 0, 0]), p, 50)) == 2  # mixed rows: the path that serves all
    assert int(sampling_path(t, jnp.asarray([3, 5, 7, 9]), p, 50)) == 1


def test_engine_draft_keeps_one_sampling_branch():
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.engine.round import draft
    from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2))
    for kind in ("dspark", "mtp1"):
        config = EngineConfig(policy="fixed", num_slots=2, max_len=16, **({"gamma": 1} if kind == "mtp1" else {}))
        eng = Engine(target, tiny_drafter(kind, target, gamma=2), config)
        st = eng.init_state()
        samp = eng.control().sampling  # traced, as the compiled round takes it: one switch over the paths
        jaxpr = jax.make_jaxpr(lambda s, sp: draft(eng.spec, eng.dp, s, s.keys, sp))(st, samp)
        assert "cond[" in str(jaxpr), kind


def test_first_argmax_and_greedy_path_flag():
    """`first_argmax` is `jnp.argmax` (first index on ties); `sampling_path` adds 3 exactly when a
    row is greedy, and greedy rows still come out one-hot when the flag is passed in."""
    from dspark_jax.decoding.sampling import first_argmax, sampling_path

    rng = np.random.default_rng(5)
    x = jnp.asarray(np.round(rng.normal(size=(64, 40)) * 2) / 2, jnp.float32)  # many ties
    np.testing.assert_array_equal(first_argmax(x), jnp.argmax(x, -1))
    t, k, p = jnp.asarray([1.0, 0.0]), jnp.asarray([0, 0]), jnp.asarray([1.0, 1.0])
    assert int(sampling_path(t, k, p, 40)) == 3
    assert int(sampling_path(jnp.asarray([1.0, 0.5]), k, p, 40)) == 0
    assert int(sampling_path(jnp.asarray([0.0, 0.5]), jnp.asarray([0, 5]), p, 40)) == 5
    got = sampling_probs(x[:2], t, k, p, path=sampling_path(t, k, p, 40))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(jax.nn.one_hot(jnp.argmax(x[1]), 40)))
    np.testing.assert_allclose(got[0], jax.nn.softmax(x[0]), atol=1e-6)
    # a path without the greedy flag gives the greedy row a softmax instead of its one-hot: caught
    wrong = sampling_probs(x[:2], t, k, p, path=jnp.int32(0))
    assert not np.allclose(np.asarray(wrong[1]), np.asarray(got[1]))


def test_no_vocabulary_sort_and_exact_tie_split():
    """Top-p and large top-k find their cut by bisection: the compiled program has no sort, and the
    cut splits tied logits exactly as a stable descending sort (lower index first) would."""
    lg = jnp.zeros((1, 200), jnp.float32).at[0, :10].set(1.0)  # 190 tied zeros after 10 tied ones
    jaxpr = str(jax.make_jaxpr(lambda x: sampling_probs(x, 1.0, 100, 0.9))(lg))
    import re

    assert not re.search(r"\bsort\[", jaxpr)  # the old full-vocabulary path was a stable argsort
    pr = np.asarray(sampling_probs(lg, 1.0, 100, 1.0))[0]
    assert (pr > 0).tolist() == [True] * 100 + [False] * 100  # k = 100: the first 90 of the tied zeros
    for tp in (0.05, 0.5, 0.9):
        pr = np.asarray(sampling_probs(lg, 1.0, 0, tp))[0]
        np.testing.assert_allclose(pr, ref_sampling_probs(np.asarray(lg[0]), 1.0, 0, tp), atol=1e-6)
        kept = np.flatnonzero(pr > 0)
        assert kept.tolist() == list(range(len(kept)))  # a prefix in index order among ties


def test_settings_known_when_traced_give_one_path_with_the_same_probabilities():
    """Constants (not arguments) pick the path in Python, so the program holds only that path
    (what the TPU cost model prices); its probabilities are the run-time choice's."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dspark_jax.decoding.sampling import sampling_path, sampling_probs

    logits = jax.random.normal(jax.random.key(0), (4, 300))
    for t, k, p in [(1.0, 0, 1.0), (0.7, 20, 0.9), (1.0, 200, 0.8), (0.0, 0, 1.0)]:
        consts = tuple(np.full(4, v, dt) for v, dt in ((t, np.float32), (k, np.int32), (p, np.float32)))
        path = sampling_path(*consts, 300)
        assert isinstance(path, int)
        assert path == int(jax.jit(sampling_path, static_argnums=3)(*consts, 300))  # traced: the same choice
        folded = jax.jit(lambda x: sampling_probs(x, *consts))(logits)
        traced = jax.jit(lambda x, a, b, c: sampling_probs(x, a, b, c))(logits, *consts)
        np.testing.assert_allclose(np.asarray(folded), np.asarray(traced), atol=1e-6)
        text = jax.jit(lambda x: sampling_probs(x, *consts)).lower(logits).as_text()
        assert "stablehlo.case" not in text and "stablehlo.if" not in text  # no switch or cond left
    assert jnp.isdtype(folded.dtype, "real floating")
