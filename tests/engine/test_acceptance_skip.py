"""The "acceptance" skip rule (drafters without a confidence head: the default of DFlash, Eagle3
and MTP-1): an engine whose drafter cannot pay stops drafting after its first rounds and stays
token-for-token the target's; one whose drafts pay keeps drafting."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig, EngineConfigError
from dspark_jax.scheduler import prefix
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
from tests.scheduler import prefix_reference as numpy_ref

GREEDY = SamplingParams(0.0, 0, 1.0)
BUCKETS = (3, 6, 12)
CONFIG = dict(num_slots=3, max_len=48, buckets=BUCKETS, prefill_buckets=(20,), probe_every=4)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5, 2)]
    ref = Engine(target, None, EngineConfig(policy="fixed", **{**CONFIG, "buckets": (3,)}))
    reference = [r.tokens for r in ref.generate(prompts, max_new_tokens=20, sampling=GREEDY).results]
    dflash = tiny_drafter("dflash", target, gamma=3)
    return target, prompts, reference, dflash, Engine(target, dflash, EngineConfig(**CONFIG))


def _drafted_rounds(engine, prompts, table):
    res = engine.generate(prompts, max_new_tokens=20, sampling=GREEDY, traces=True, table=table)
    tr = res.traces.arrays()
    rounds = np.unique(tr["round"])
    return res, {int(r) for r in rounds if (tr["length"][tr["round"] == r] > 0).any()}, len(rounds)


def test_an_untrained_drafter_is_skipped_and_the_output_is_the_targets(setup):
    """A table on which all-accepted drafts would pay (a draft costs 0.6 of a step) and this
    untrained drafter's acceptance does not: the default scheduling (policy fixed, the
    "acceptance" rule) drafts until it knows 8 rows (3 rounds at 3 slots), then what those rounds
    lost leaves no credit for a probe, so it drafts again only where a changed load has no
    settled "no"; the
    "best_case" rule, which does not read the acceptance, drafts every round."""
    target, prompts, reference, dflash, default = setup
    table = prefix.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.6)
    assert numpy_ref.speculation_pays_np(3, prefix.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.6,
                                                              as_numpy=True), 9, mode="latency")
    assert default.scheduling == "fixed, skip rule acceptance"
    res, drafted, n_rounds = _drafted_rounds(default, prompts, table)
    assert [r.tokens for r in res.results] == reference
    assert 0 in drafted and not {4, 8} & drafted and len(drafted) <= n_rounds / 4, (drafted, n_rounds)
    # it indeed cannot pay: 3 slots x 3 drafts (2.8 steps) need 1.8 accepted a slot to beat 3 steps
    assert sum(r.accepted for r in res.results) < 1.8 * 3 * len(drafted)
    best_case = Engine(target, dflash, EngineConfig(**CONFIG, policy="fixed", skip_drafting="best_case"))
    res, drafted, n_rounds = _drafted_rounds(best_case, prompts, table)
    assert [r.tokens for r in res.results] == reference and len(drafted) == n_rounds


def test_drafts_that_pay_keep_the_drafter_running(setup):
    """Free drafts and a flat verification price: any acceptance pays, so every round drafts."""
    _, prompts, reference, _, default = setup
    table = prefix.make_table(BUCKETS, t_verify=(1.0, 1.0, 1.0), t_draft=0.0)
    res, drafted, n_rounds = _drafted_rounds(default, prompts, table)
    assert [r.tokens for r in res.results] == reference and len(drafted) == n_rounds


def test_the_rule_prices_fixed_rounds_only(setup):
    target = setup[0]
    with pytest.raises(EngineConfigError, match="skip_drafting 'known' with a scheduler"):
        Engine(target, tiny_drafter("dspark", target, gamma=3),
               EngineConfig(**CONFIG, policy="production", skip_drafting="acceptance"))
