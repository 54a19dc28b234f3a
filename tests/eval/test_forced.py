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
    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=64, **kw))
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, stop_ids=(7,), traces=True)
    assert [r.tokens for r in res.results] == continuations  # what greedy speculative decoding commits
    want = res.traces.arrays()
    got = forced_traces(target, d, prompts, continuations, **kw)
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
