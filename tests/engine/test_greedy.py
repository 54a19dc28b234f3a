"""Greedy speculative decoding is token-for-token the target's greedy decoding, for every drafter kind.

Mixed prompt lengths, 5 requests on 3 slots (slots are refilled mid-run). The target-only
path is itself checked against a cache-free full forward, with a top-2 margin guard
against near-ties. Also: one compiled round program for all buckets and settings, one
dispatch per round, host loop == while loop.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.programs import clear_shared_programs
from dspark_jax.testing.tiny import tiny_drafter

GREEDY = SamplingParams(0.0, 0, 1.0)
MAX_NEW = 12


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5, 2)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    eng = Engine(target, None, EngineConfig(policy="fixed",
                                            num_slots=3, max_len=40, buckets=(3,), prefill_buckets=(20,)))
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY)
    out = [r.tokens for r in res.results]
    for p, o in zip(prompts, out):  # cache-free check + margin guard
        logits = np.asarray(target(jnp.asarray([p + o])).logits[0])
        rows = logits[len(p) - 1: len(p) - 1 + len(o)]
        assert (rows.argmax(-1) == np.asarray(o)).all()
        top2 = np.sort(rows, axis=-1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 1e-3, "near-tie in the greedy path: pick other prompts"
    assert len({tuple(o) for o in out}) > 1 and any(len(set(o)) > 2 for o in out)  # not degenerate
    assert eng.compiled_rounds() == 1
    assert eng.compiled_programs() == 2  # the round and the one prefill bucket
    eng.generate(prompts[:1], max_new_tokens=2, sampling=GREEDY)
    assert eng.compiled_programs() == 2  # warm: nothing new
    return out


@pytest.mark.parametrize("kind", ["dspark", "dflash", "eagle3", "mtp1", "dspark_rnn"])
def test_greedy_equals_target(target, prompts, reference, kind):
    base = "dspark" if kind == "dspark_rnn" else kind
    d = tiny_drafter(base, target, gamma=3, head_type="rnn" if kind == "dspark_rnn" else "vanilla")
    kw = dict(gamma=3, layer_ids=[0]) if kind == "eagle3" else {}
    G = 1 if kind == "mtp1" else 3
    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=(3 * (G + 1),), prefill_buckets=(20,),
                                         policy="fixed", **kw))
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY)
    assert [r.tokens for r in res.results] == reference
    # one dispatch per round: the host loop made exactly as many calls as rounds ran
    assert res.round_calls == eng.round_calls
    assert eng.compiled_rounds() == 1


def test_buckets_policies_and_loops_one_program(target, prompts, reference):
    """Several buckets, fixed / threshold gamma and sampling changes: one round program; the
    while loop gives the same tokens; accepted lengths are >= 1 and tau > 1 with real acceptance."""
    d = tiny_drafter("dspark", target, gamma=3)
    eng = Engine(target, d, EngineConfig(policy="fixed",
                                         num_slots=3, max_len=40, prefill_buckets=(20,)))  # default buckets (3, 6, 12)
    assert len(eng.buckets) == 3
    out = {}
    for gamma in (3, 1, 0):
        res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, gamma=gamma, traces=True)
        assert [r.tokens for r in res.results] == reference
        tr = res.traces.arrays()
        assert (tr["length"] == gamma).all()
        out[gamma] = res
    assert out[0].tau == 1.0 and out[3].tau > 1.0
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=SamplingParams(0.8, 5, 0.9), threshold=0.5)
    assert all(len(r.tokens) == MAX_NEW for r in res.results)
    assert eng.compiled_rounds() == 1
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, loop="while")
    assert [r.tokens for r in res.results] == reference
    assert res.round_calls < sum(r.rounds for r in res.results)


def test_threshold_policy_traces(target, prompts):
    d = tiny_drafter("dspark", target, gamma=3)
    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=(12,), prefill_buckets=(20,),
                                        policy="threshold"))
    res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, threshold=0.5, traces=True)
    tr = res.traces.arrays()
    a = np.cumprod(1 / (1 + np.exp(-tr["conf_logits"])), axis=1)
    want = np.sum(np.cumprod(a >= 0.5, axis=1), axis=1)
    np.testing.assert_array_equal(tr["length"], want)
    assert (tr["accepted"] <= tr["length"]).all()
    assert tr["full"].dtype == bool and len(tr["request"]) == sum(r.rounds for r in res.results)


def test_rounds_that_verify_no_drafts_take_the_one_column_view(target, prompts, reference, monkeypatch):
    """A policy that can verify no drafts compiles a second, one-column attention view (a skipped
    round attended with gamma + 1 queries per row: 1.4 x a target-only step on SmolLM2). Greedy
    output stays the target's whether every round, none or some take it; a round that took the
    narrow view while a row verified drafts (the width chosen wrongly) is caught."""
    from dspark_jax.engine import round as round_mod

    d = tiny_drafter("dspark", target, gamma=3)
    fixed = Engine(target, d, EngineConfig(policy="fixed", num_slots=3, max_len=40, prefill_buckets=(20,)))
    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, prefill_buckets=(20,), policy="threshold"))
    assert fixed.spec.widths == (4,) and eng.spec.widths == (1, 4)
    lengths = []
    for threshold in (1.01, 0.0, 0.3):  # never draft / always gamma / mixed rounds
        res = eng.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, threshold=threshold, traces=True)
        assert [r.tokens for r in res.results] == reference, threshold
        lengths.append(res.traces.arrays()["length"])
    assert (lengths[0] == 0).all() and (lengths[1] == 3).all() and 0 < (lengths[2] > 0).mean() < 1
    assert eng.compiled_rounds() == 1
    # the mutation: always the narrow view -> drafts verified against rows that were never forwarded
    monkeypatch.setattr(round_mod, "_width_index", lambda widths, act, lengths: jnp.int32(0))
    clear_shared_programs()  # the engine below must trace the mutated round, not reuse eng's programs
    broken = Engine(target, d, EngineConfig(num_slots=3, max_len=40, prefill_buckets=(20,), policy="threshold"))
    res = broken.generate(prompts, max_new_tokens=MAX_NEW, sampling=GREEDY, threshold=0.0)
    assert [r.tokens for r in res.results] != reference
