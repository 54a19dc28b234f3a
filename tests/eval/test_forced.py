"""Teacher-forced greedy evaluation (eval/forced.py) is the engine's greedy speculative decoding,
round by round, for every drafter kind: same accepted drafts, same cut rounds, same confidences."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.eval.forced import GREEDY, accepted_at, forced_rounds, forced_traces, greedy_continuations
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

MAX_NEW = 20
G = 3


@pytest.fixture(scope="module")
def target():
    return tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5, 2, 11)]


@pytest.fixture(scope="module")
def continuations(target, prompts):
    return greedy_continuations(target, prompts, max_new_tokens=MAX_NEW, stop_ids=(7,), num_slots=3)


def test_accepted_at_counts_the_matching_prefix():
    seq = np.asarray([5, 1, 2, 3, 4])
    drafts = np.asarray([[1, 2, 9], [2, 3, 4], [3, 4, 4], [9, 9, 9]])
    assert accepted_at(drafts, seq, np.asarray([0, 1, 2, 3])).tolist() == [2, 3, 2, 0]  # past the end: no match


def test_rounds_advance_past_the_kept_tokens_and_the_last_is_cut():
    # tokens 0..5 to come; round at 0 accepts 2 (keeps 3), at 3 accepts 0, at 4 accepts 3 of which 1 fits
    r = forced_rounds(np.asarray([2, 9, 9, 0, 3, 9]), 6)
    assert r["start"].tolist() == [0, 3, 4] and r["accepted"].tolist() == [2, 0, 1]
    assert r["cut"].tolist() == [False, False, True]


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "mtp1"])
def test_forced_rounds_are_the_engines_rounds(target, prompts, continuations, kind):
    d = tiny_drafter(kind, target, gamma=G)
    kw = dict(gamma=G, layer_ids=[0]) if kind == "eagle3" else {}
    eng = Engine(target, d, EngineConfig(policy="fixed", num_slots=3, max_len=64, **kw))
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, stop_ids=(7,), traces=True)
    assert [r.tokens for r in res.results] == continuations  # what greedy speculative decoding commits
    want = res.traces.arrays()
    got = forced_traces(target, {kind: d}, prompts, continuations, **kw)[kind]
    for r in range(len(prompts)):
        w = want["request"] == r
        order = np.argsort(want["round"][w], kind="stable")
        g = got["request"] == r
        assert got["accepted"][g].tolist() == want["accepted"][w][order].tolist(), (kind, r)
        assert got["cut"][g].tolist() == want["cut"][w][order].tolist(), (kind, r)
        if kind == "dspark":
            np.testing.assert_allclose(got["conf_logits"][g], want["conf_logits"][w][order], rtol=1e-4, atol=1e-4)
    assert got["request_accepted"].tolist() == [x.accepted for x in res.results]
    assert got["request_rounds"].tolist() == [x.rounds for x in res.results]
    acc = got["accepted"]
    if kind != "mtp1":  # not a degenerate comparison: rounds that accept nothing and rounds that accept more
        assert (acc == 0).any() and (acc >= 2).any(), acc
    else:
        assert (acc == 0).any() and (acc == 1).any(), acc


def test_block_kinds_forced_logits_accept_what_their_inference_head_accepts(target, prompts, continuations):
    """The teacher-forced logits (what T > 0 reads) give the greedy drafts' accepted lengths too."""
    import jax.numpy as jnp

    from dspark_jax.eval.forced import _drafts, _parts, _sequences

    d = tiny_drafter("dspark", target, gamma=G)
    parts, *_ = _parts(target, {"d": d}, None, None)
    kind, shape, dparams = parts["d"]
    for r, seq, tok, anc, anchors in _sequences(prompts, continuations, parts):
        out = target(tok, feature_layers=shape.feature_layers, return_logits=False)
        drafts, _ = _drafts(kind, shape, shape.feature_layers, dparams, out, tok, anc)
        argmax = jnp.argmax(kind.forced_logits(dparams, shape, out, tok, anc), -1)
        m = len(anchors)
        np.testing.assert_array_equal(accepted_at(np.asarray(argmax[0, :m]), seq, anchors),
                                      accepted_at(np.asarray(drafts[0, :m]), seq, anchors))


def test_expected_first_slot_acceptance_is_the_engines_rate_at_t1(target):
    """Slot 0 of a request's first round sees the prompt alone, so its forced rate 1 - TV(q_0, p_0)
    is exactly the probability that the engine accepts a draft there. 480 requests of one prompt
    at T = 1: the observed share lies within 4 standard errors (<= 0.023; a false alarm once in
    about 16,000 runs) of the rate, and the broken variant 1 - ||q - p||_1 (TV without its half)
    lies more than 4 of them away."""
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.eval.forced import expected_acceptance

    t1 = SamplingParams(1.0, 0, 1.0)
    d = tiny_drafter("dspark", target, gamma=G)
    candidates = [[3, 9, 4, 1], [5, 2, 8], [12, 0, 6, 6, 2], [1, 14, 3]]
    ex = expected_acceptance(target, {"d": d}, candidates, [[0] * (G + 1)] * len(candidates), t1)["d"]
    rates = [r["rates"][0, 0] for r in ex["requests"]]
    i = int(np.argmin(np.abs(np.asarray(rates) - 0.5)))
    prompt, rate = candidates[i], float(rates[i])
    assert 0.2 < rate < 0.8, rates  # a rate a wrong one cannot match by accident at 0 or 1
    n = 480
    eng = Engine(target, d, EngineConfig(policy="fixed", num_slots=8, max_len=32))
    res = eng.generate([prompt] * n, max_new_tokens=G + 1, sampling=t1, stop_ids=(), seed=3, traces=True)
    tr = res.traces.arrays()
    first = np.asarray([tr["accepted"][(tr["request"] == r)][np.argmin(tr["round"][tr["request"] == r])]
                        for r in range(n)])
    share = float(np.mean(first >= 1))
    se = np.sqrt(rate * (1 - rate) / n)
    assert abs(share - rate) < 4 * se, (share, rate)
    broken = max(0.0, 1 - 2 * (1 - rate))  # 1 - ||q - p||_1 = 1 - 2 TV
    assert abs(share - broken) > 4 * se


def test_every_slots_rate_is_one_minus_tv_against_the_targets_row(target, prompts, continuations):
    """Slot j of the block anchored at position a: 1 - TV(q_aj, p_(a+j)), the target's sampling
    distribution (temperature, top-k, top-p) at row a + j, against a float64 reference that
    normalises each row on its own (tests/_reference.py); the target's rows one position early or
    late give other rates here, so a slot read off the wrong row fails."""
    from dspark_jax.decoding.sampling import SamplingParams, probs_from_params
    from dspark_jax.eval.forced import _parts, _sequences, expected_acceptance
    from tests._reference import ref_sampling_probs

    sp = SamplingParams(0.8, 6, 0.9)
    d = tiny_drafter("dspark", target, gamma=G)
    requests = expected_acceptance(target, {"d": d}, prompts, continuations, sp)["d"]["requests"]
    parts = _parts(target, {"d": d}, None, None)[0]
    kind, shape, dparams = parts["d"]
    checked, off_by_one = 0, []
    for (_, seq, tok, anc, anchors), req in zip(_sequences(prompts, continuations, parts), requests):
        out = target(tok, feature_layers=shape.feature_layers, return_logits=True)
        q = np.asarray(probs_from_params(kind.forced_logits(dparams, shape, out, tok, anc), sp), np.float64)[0]
        logits = np.asarray(out.logits, np.float64)[0]

        def rate(a, j, row):
            p = ref_sampling_probs(logits[row], sp.temperature, sp.top_k, sp.top_p)
            return float(np.clip(1.0 - 0.5 * np.abs(q[a, j] - p).sum(), 0.0, 1.0))

        for a, pos in enumerate(anchors):
            for j in range(shape.G):
                if pos + 1 + j >= len(seq):
                    assert np.isnan(req["rates"][a, j])
                    continue
                assert req["rates"][a, j] == pytest.approx(rate(a, j, pos + j), abs=2e-5), (a, j)
                off_by_one += [abs(req["rates"][a, j] - rate(a, j, pos + j + k)) for k in (-1, 1)]
                checked += 1
    assert checked >= 100 and max(off_by_one) > 0.05


def test_one_target_pass_serves_drafters_of_different_feature_layers(prompts):
    """Several drafters at once (the target's features gathered for the union of their layers) give
    each the traces it gets alone."""
    from flax import nnx

    from dspark_jax.config import DrafterSection
    from dspark_jax.drafter import registry
    from dspark_jax.drafter.frozen import attach_target
    from dspark_jax.parallel.sharding import create_model

    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=4), logit_scale=1.0)
    conts = greedy_continuations(target, prompts, max_new_tokens=MAX_NEW, num_slots=3)

    def drafter(kind, layers, seed):
        dcfg = DrafterSection(kind=kind, num_layers=1, gamma=G, target_layer_ids=layers,
                              num_target_features=len(layers), markov_rank=8, mask_token_id=target.cfg.vocab_size - 1)
        d = create_model(lambda: registry.build(target.cfg, dcfg, rngs=nnx.Rngs(seed)))
        attach_target(d, target)
        return d

    ds = {"a": drafter("dspark", (2,), 4), "b": drafter("dflash", (0, 2), 5), "c": drafter("dspark", (1,), 6)}
    both = forced_traces(target, ds, prompts, conts)
    for name, d in ds.items():
        alone = forced_traces(target, {name: d}, prompts, conts)[name]
        for k in ("accepted", "cut", "request_rounds"):
            np.testing.assert_array_equal(both[name][k], alone[k])
        np.testing.assert_allclose(both[name]["conf_logits"], alone["conf_logits"], atol=1e-5)
    # the drafters differ (else a mix-up of their features could go unseen)
    assert not np.array_equal(both["a"]["conf_logits"], both["c"]["conf_logits"])
