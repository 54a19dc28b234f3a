"""Acceptance profiles (calibration/profiles.py): traces whose tau is the published one, and the
refusals of profiles that do not fit the drafter."""

import numpy as np
import pytest

from dspark_jax.calibration.profiles import PROFILES, parse_profile, profile_traces, rates_tau


@pytest.mark.parametrize("name", ["paper-4b-gsm8k-dspark", "paper-4b-arena-hard-dflash", "tpu-inference-4b-dflash-k16"])
def test_traces_have_the_profiles_tau_and_block(name):
    p = PROFILES[name]
    ts = profile_traces(p)
    assert abs(ts.tau() - p.tau) <= 0.01 and ts.gamma == p.gamma
    assert p.source in ts.meta["source"]
    again = profile_traces(p)  # the same profile gives the same traces
    np.testing.assert_array_equal(again.accepted, ts.accepted)


def test_the_kind_shapes_the_decay_at_equal_tau():
    """DSpark's sequential head keeps later positions accepted: at equal tau a DFlash profile
    accepts more often early and less often late (per-position acceptance, docs/method.md §1)."""
    ds = profile_traces(parse_profile("tau:4.5", kind="dspark"))
    df = profile_traces(parse_profile("tau:4.5", kind="dflash"))
    share = lambda ts, j: float(np.mean(ts.accepted >= j))
    assert share(df, 1) > share(ds, 1) and share(df, 7) < share(ds, 7)


def test_given_tau_and_rates():
    assert parse_profile("tau:5.4").tau == 5.4
    rates = [0.94, 0.9, 0.85, 0.8, 0.72, 0.65, 0.59]
    p = parse_profile("rates:" + ",".join(map(str, rates)))
    assert p.tau == pytest.approx(rates_tau(rates)) == pytest.approx(1 + sum(rates))


@pytest.mark.parametrize("text,msg", [
    ("rates:0.9,0.8", "gives 2 per-position rates, the drafter drafts gamma = 7: give exactly 7"),
    ("rates:0.9,0.8,0.7,0.6,0.5,0.4,0.3,0.2", "gives 8 per-position rates"),
    ("rates:0.5,0.9,0.4,0.3,0.2,0.1,0.05", "not increase"),
    ("tau:9.5", r"tau must lie in 1 \.\. gamma \+ 1 = 8"),
    ("paper-gsm8k", "unknown acceptance profile 'paper-gsm8k': give one of .*deepspec-8b-gsm8k-dspark"),
])
def test_profiles_that_do_not_fit_are_refused(text, msg):
    with pytest.raises(ValueError, match=msg):
        parse_profile(text, gamma=7)
