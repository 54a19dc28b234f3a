"""The prefix scheduler inside the engine's compiled round.

For each scheduler variant the compiled round (one program) chooses, per round, exactly
the lengths the numpy reference scheduler chooses from the same confidences, the greedy
output stays token-for-token the target's, and admitted lengths differ across requests
(the scheduler is doing something).
"""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.scheduler import prefix as scheduler
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
from tests.scheduler import prefix_reference as numpy_ref

GREEDY = SamplingParams(0.0, 0, 1.0)
BUCKETS = (3, 6, 12)
# flat at small batches, then rising (accelerator-like), with a draft cost
TABLE = dict(buckets=BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.4)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 15, n).tolist() for n in (3, 9, 17, 5, 2)]
    ref = Engine(target, None, EngineConfig(policy="fixed",
                                            num_slots=3, max_len=40, buckets=(3,), prefill_buckets=(20,)))
    reference = [r.tokens for r in ref.generate(prompts, max_new_tokens=12, sampling=GREEDY).results]
    return target, prompts, reference


def _reference_lengths(policy, a, table):
    active = np.ones(a.shape[0], bool)
    if policy == "early_stop":
        return numpy_ref.schedule_early_stop_np(a, active, table, mode="latency")
    return numpy_ref.schedule_static_np(a, active, table, mode="latency")[0]


@pytest.mark.parametrize("policy", ["early_stop", "static", "production"])
def test_scheduler_in_compiled_round(setup, policy):
    target, prompts, reference = setup
    d = tiny_drafter("dspark", target, gamma=3)
    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,),
                                         policy=policy))
    res = eng.generate(prompts, max_new_tokens=12, sampling=GREEDY, traces=True,
                       table=scheduler.make_table(**TABLE))
    assert [r.tokens for r in res.results] == reference  # lossless (greedy)
    assert eng.compiled_rounds() == 1 and res.round_calls == eng.round_calls
    tr = res.traces.arrays()
    assert len(set(tr["length"].tolist())) > 1  # lengths vary: the scheduler decides
    assert (tr["accepted"] <= tr["length"]).all()
    if policy == "production":
        # capacity from stale survivals; per round the admitted total never exceeds the largest bucket
        for rnd in np.unique(tr["round"]):
            rows = tr["round"] == rnd
            assert np.sum(1 + tr["length"][rows]) <= BUCKETS[-1]
        return
    table_np = scheduler.make_table(**TABLE, as_numpy=True)
    checked = 0
    for rnd in np.unique(tr["round"]):
        rows = tr["round"] == rnd
        a = numpy_ref.prefix_survival_np(tr["conf_logits"][rows])
        np.testing.assert_array_equal(tr["length"][rows], _reference_lengths(policy, a, table_np),
                                      err_msg=f"round {rnd}")
        checked += 1
    assert checked >= 5


def test_scheduler_objective_is_configurable(setup):
    """theta="sps" (the paper's tau * SPS(B)) makes other choices than "latency" on a table with a
    large draft time, and each equals the numpy scheduler with that objective."""
    target, prompts, reference = setup
    d = tiny_drafter("dspark", target, gamma=3)
    table = dict(buckets=BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=3.0)
    table_np = scheduler.make_table(**table, as_numpy=True)
    lengths = {}
    for theta in ("sps", "latency"):
        eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,),
                                             policy="early_stop", theta=theta))
        res = eng.generate(prompts, max_new_tokens=12, sampling=GREEDY, traces=True,
                           table=scheduler.make_table(**table))
        assert [r.tokens for r in res.results] == reference
        tr = res.traces.arrays()
        for rnd in np.unique(tr["round"]):
            rows = tr["round"] == rnd
            a = numpy_ref.prefix_survival_np(tr["conf_logits"][rows])
            ref = numpy_ref.schedule_early_stop_np(a, np.ones(rows.sum(), bool), table_np, mode=theta)
            np.testing.assert_array_equal(tr["length"][rows], ref, err_msg=f"{theta} round {rnd}")
        lengths[theta] = tr["length"]
    # under "latency" the (large) draft time is paid whatever is verified, so extra tokens are relatively cheaper
    assert lengths["latency"].sum() > lengths["sps"].sum()


def test_bad_objective_names(setup):
    target = setup[0]
    d = tiny_drafter("dspark", target, gamma=3)
    with pytest.raises(ValueError, match="theta='speed'.*sps, latency"):
        Engine(target, d, EngineConfig(num_slots=3, max_len=40, policy="early_stop", theta="speed"))
    with pytest.raises(ValueError, match="cost model 'linear'.*step, interp"):
        Engine(target, d, EngineConfig(num_slots=3, max_len=40, policy="production", cost="linear"))


def test_skip_drafting_inside_the_round(setup):
    """When the table says no speculation pays, the compiled round skips the drafter (a cond in
    the same program): every length is 0 and the output is still the target's; with a table
    where speculation pays, the same compiled round drafts again."""
    import jax

    target, prompts, reference = setup
    d = tiny_drafter("dspark", target, gamma=3)
    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,),
                                         policy="early_stop", skip_drafting=True))
    never = scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=50.0)  # drafting costs 50 steps
    res = eng.generate(prompts, max_new_tokens=12, sampling=GREEDY, traces=True, table=never)
    assert [r.tokens for r in res.results] == reference
    tr = res.traces.arrays()
    assert (tr["length"] == 0).all() and (tr["conf_logits"] == 0).all()  # the drafter never ran
    res = eng.generate(prompts, max_new_tokens=12, sampling=GREEDY, traces=True, table=scheduler.make_table(**TABLE))
    assert [r.tokens for r in res.results] == reference
    assert res.traces.arrays()["length"].max() > 0
    assert eng.compiled_rounds() == 1
    st = eng.init_state()
    jaxpr = str(jax.make_jaxpr(lambda s: eng._round(eng.tp, eng.dp, s, eng.control(table=never)))(st))
    assert "cond[" in jaxpr


def test_a_round_where_every_slot_skips_is_the_target_only_round(setup):
    """When the skip rule says no slot drafts, the round is the target-only engine's
    (`round.plain_round`): from the same prefilled state and keys, every round's tokens,
    positions and target cache equal a target-only engine's, at temperature 1 too (a drafting
    round that verified no drafts drew its token through rejection sampling, with other coins),
    the drafter never runs, and greedy output is plain target decoding's. Here even perfect
    drafts would not pay (the "known" rule's settled rounds): the drafter's state is left as it
    was."""
    import jax

    target, prompts, reference = setup
    d = tiny_drafter("dspark", target, gamma=3)
    cfg = dict(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,))
    eng = Engine(target, d, EngineConfig(**cfg, policy="production", skip_drafting="known"))
    plain = Engine(target, None, EngineConfig(policy="fixed", **cfg))
    never = scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=50.0)  # drafting costs 50 steps
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 3)))
    for sampling in (SamplingParams(1.0, 0, 1.0), GREEDY):
        st = eng.prefill_slots(eng.init_state(), [0, 1, 2], prompts[:3], kd, [12] * 3)
        drafter = [np.asarray(x) for x in jax.tree.leaves((st.dcache, st.last))]
        st0 = plain.prefill_slots(plain.init_state(), [0, 1, 2], prompts[:3], kd, [12] * 3)
        for _ in range(8):
            st, ro = eng.step(st, eng.control(sampling, table=never))
            st0, ro0 = plain.step(st0, plain.control(sampling))
            assert (np.asarray(ro.lengths) == 0).all() and (np.asarray(ro.z) == 0).all()  # no draft
            assert int(ro.bucket) == int(ro0.bucket)
        for f in ("out", "n_gen", "pos", "anchor", "active"):
            np.testing.assert_array_equal(np.asarray(getattr(st, f)), np.asarray(getattr(st0, f)), err_msg=f)
        for a, b in zip(jax.tree.leaves(st.cache), jax.tree.leaves(st0.cache)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves((st.dcache, st.last)), drafter):
            np.testing.assert_array_equal(np.asarray(a), b)
    res = eng.generate(prompts, max_new_tokens=12, sampling=GREEDY, table=never)
    assert [r.tokens for r in res.results] == reference
    assert all(r.accepted == 0 for r in res.results)


def test_production_after_skipped_rounds_uses_default_capacity(setup):
    """Rounds that skipped drafting have no survivals; two rounds later the production scheduler
    must fall back to its default capacity, not read "nothing pays" from them."""
    import jax

    target, prompts, _ = setup
    d = tiny_drafter("dspark", target, gamma=3)
    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,),
                                         policy="production", skip_drafting=True))
    never = scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=50.0)
    pays = scheduler.make_table(**TABLE)
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 3)))
    st = eng.prefill_slots(eng.init_state(), [0, 1, 2], prompts[:3], kd, [30] * 3)
    for _ in range(2):
        st, ro = eng.step(st, eng.control(GREEDY, table=never))
        assert (np.asarray(ro.lengths) == 0).all()
    st, ro = eng.step(st, eng.control(GREEDY, table=pays, default_k=5))
    a = numpy_ref.prefix_survival_np(np.asarray(ro.z))
    tab = scheduler.make_table(**TABLE, as_numpy=True)
    ref = numpy_ref.schedule_production_np(a, np.ones(3, bool), None, False, tab, 5, mode="latency")[0]
    np.testing.assert_array_equal(np.asarray(ro.lengths), ref)
    assert ref.sum() == 5  # the default capacity, where stale zeros would have given 0


def test_skip_on_known_survivals_probes_and_stays_lossless(setup):
    """With a table where perfect drafts would pay but these drafters' survivals do not (draft
    time 0.6 of a step), the "known" rule drafts in round 0 (no survivals yet; a request that
    joins later takes the others' survivals), but probes no more: round 0's draft cost more than
    it saved, so no credit covers a probe (`prefix.drafting_gain`; probing with credit:
    test_a_round_that_may_lose_drafts_only_while_the_credit_covers_it); "best_case" never skips;
    the output is unchanged."""
    target, prompts, reference = setup
    d = tiny_drafter("dspark", target, gamma=3)
    table = scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.6)
    tab_np = scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.6, as_numpy=True)
    assert numpy_ref.speculation_pays_np(3, tab_np, 9, mode="latency")
    drafted = {}
    for rule in ("best_case", "known"):
        eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,),
                                             policy="early_stop", skip_drafting=rule, probe_every=4))
        res = eng.generate(prompts, max_new_tokens=12, sampling=GREEDY, traces=True, table=table)
        assert [r.tokens for r in res.results] == reference
        tr = res.traces.arrays()
        ran = {int(r) for r in np.unique(tr["round"]) if (tr["conf_logits"][tr["round"] == r] != 0).any()}
        drafted[rule] = ran
        n_rounds = len(np.unique(tr["round"]))
    assert len(drafted["best_case"]) == n_rounds
    # round 0 (nothing known) drafts; no probe follows (round 4 and 8 would have been the first);
    # other drafted rounds come from a changed set of active requests
    known = drafted["known"]
    assert 0 in known and not {4, 8} & known and len(known) <= n_rounds / 4, (known, n_rounds)


def _known_rule_engine(target):
    """A 3-slot engine under the "known" skip rule, its controls on a table where a draft costs
    0.6 of a one-token verification, and that table in numpy (for `numpy_ref`)."""
    eng = Engine(target, tiny_drafter("dspark", target, gamma=3),
                 EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,), policy="early_stop",
                              skip_drafting="known", probe_every=4))
    ctl = eng.control(GREEDY, table=scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.6))
    return eng, ctl, scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.6, as_numpy=True)


def test_a_settled_no_stops_probes_until_fewer_slots_decode(setup):
    """After a drafted round whose survivals say no admission count pays by more than their
    sampling error (`prefix.settled_no`), the probe gap becomes -n (n the slots decoding): the
    "known" rule then drafts no probe while at least n slots decode, and probes at once when
    fewer do (here with a credit that covers the probe); a "no" within its error keeps the
    doubling backoff."""
    import jax.numpy as jnp

    from dspark_jax.engine import round as round_mod

    eng, ctl, tab_np = _known_rule_engine(setup[0])
    # per-position survivals of the three slots: alike (a "no" beyond its error) or spread out (within it)
    alike = np.cumprod(np.array([[0.3] * 3, [0.4] * 3, [0.5] * 3]), axis=1)
    apart = np.cumprod(np.array([[0.3] * 3, [0.5] * 3, [0.7] * 3]), axis=1)
    for a, settles in ((alike, True), (apart, False)):
        act = np.ones(3, bool)
        assert not numpy_ref.known_speculation_pays_np(a, act, tab_np)
        assert numpy_ref.settled_no_np(a, act, tab_np) is settles
        st = eng.init_state()._replace(active=jnp.ones(3, bool), probe_gap=jnp.int32(8))
        _, gap, _ = round_mod._probe_schedule(eng.spec, st, jnp.asarray(a, jnp.float32), jnp.asarray(act), ctl,
                                              0.0, 0.0)
        assert int(gap) == (-3 if settles else 16)
    st = eng.init_state()._replace(a_hist=jnp.stack([jnp.asarray(alike, jnp.float32)] * 2), since_draft=jnp.int32(99),
                                   probe_gap=jnp.int32(-3), probe_credit=jnp.float32(100.0))
    for act, probes in (((True, True, True), False), ((True, True, False), True)):
        pays, settled = round_mod._skip_decision(eng.spec, st, jnp.asarray(act), ctl, 9)
        assert bool(pays) is probes and bool(settled) is not probes, act


def test_a_join_borrows_the_survivals_of_the_slots_that_have_them(setup):
    """A slot that joined since the last drafted round has no survivals of its own (-1); it takes
    the mean of the other decoding slots' survivals, so a settled "no" holds across the join and
    the round does not draft (it drafted before: a forced drafting round per join, the SmolLM2
    server's loss at c = 4, docs/serving.md). With no slot known the round still drafts."""
    import jax.numpy as jnp

    from dspark_jax.engine import round as round_mod

    eng, ctl, _ = _known_rule_engine(setup[0])
    alike = np.cumprod(np.array([[0.3] * 3, [0.4] * 3, [1.0] * 3]), axis=1)
    alike[2] = -1.0  # slot 2 joined: nothing known of it
    st = eng.init_state()._replace(a_hist=jnp.stack([jnp.asarray(alike, jnp.float32)] * 2), since_draft=jnp.int32(1),
                                   probe_gap=jnp.int32(-2))
    three = jnp.ones(3, bool)
    borrowed = np.asarray(round_mod._borrowed(jnp.asarray(alike, jnp.float32), three))
    np.testing.assert_allclose(borrowed[2], alike[:2].mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(borrowed[:2], alike[:2], rtol=1e-6)
    pays, settled = round_mod._skip_decision(eng.spec, st, three, ctl, 9)
    assert not bool(pays) and bool(settled)
    nothing = st._replace(a_hist=jnp.full_like(st.a_hist, -1.0), probe_gap=jnp.int32(8))
    pays, _ = round_mod._skip_decision(eng.spec, nothing, three, ctl, 9)
    assert bool(pays)


def test_one_slot_settles_on_the_realised_acceptance(setup):
    """One slot's survivals never settle a "no" by their spread over slots (`prefix.settled_no`
    needs two), but the drafted rounds' realised acceptance can: when they accepted significantly
    fewer drafts than the head's survivals expected (the accepted count raised by SETTLE_Z of its
    Poisson errors still short of them) and the survivals scaled by that most the acceptance may
    be say no, the gap becomes -1 even where the head's own survivals say drafting pays. Drafts
    accepted as expected, or too few drafted rounds to tell, keep the backoff. (Before the rule
    read the rounds, a one-slot server probed a useless drafter every few rounds for ever.)"""
    import jax.numpy as jnp

    from dspark_jax.engine import round as round_mod

    eng, ctl, tab_np = _known_rule_engine(setup[0])
    a = np.cumprod(np.full((3, 3), 0.9), axis=1)
    act = np.array([True, False, False])
    assert numpy_ref.known_speculation_pays_np(a, act, tab_np)  # on its face the head says drafting pays
    st = eng.init_state()._replace(active=jnp.asarray(act), probe_gap=jnp.int32(8))
    for expected, accepted, settles in ((40.0, 0.0, True), (40.0, 36.0, False), (1.0, 0.0, False)):
        _, gap, _ = round_mod._probe_schedule(eng.spec, st, jnp.asarray(a, jnp.float32), jnp.asarray(act), ctl,
                                              jnp.float32(expected), jnp.float32(accepted))
        assert (int(gap) == -1) is settles, (expected, accepted, int(gap))
    # at a load the settled verdict was not taken at (three slots, gap -1 says nothing of them),
    # the realised acceptance still keeps the rule from probing; without it the round probes
    three = jnp.ones(3, bool)
    base = eng.init_state()._replace(a_hist=jnp.stack([jnp.asarray(a, jnp.float32)] * 2), since_draft=jnp.int32(99),
                                     probe_gap=jnp.int32(-4), probe_credit=jnp.float32(100.0))
    for expected, accepted, probes in ((40.0, 0.0, False), (0.0, 0.0, True)):
        st = base._replace(calib_expected=jnp.float32(expected), calib_accepted=jnp.float32(accepted))
        pays, settled = round_mod._skip_decision(eng.spec, st, three, ctl, 9)
        assert bool(pays) is probes and bool(settled) is not probes, (expected, accepted)


def test_a_round_that_may_lose_drafts_only_while_the_credit_covers_it(setup):
    """A probe (the known survivals say no within their sampling error) drafts only while
    `probe_credit`, what earlier drafted rounds saved by their own survivals, covers the lower
    bound of its gain (`prefix.drafting_gain`); otherwise the round is settled (it need not keep
    the drafter's context). A drafted round adds its fresh survivals' gain to the credit."""
    import jax.numpy as jnp

    from dspark_jax.engine import round as round_mod

    eng, ctl, _ = _known_rule_engine(setup[0])
    table = ctl.table
    apart = jnp.asarray(np.cumprod(np.array([[0.3] * 3, [0.5] * 3, [0.7] * 3]), axis=1), jnp.float32)
    act = jnp.ones(3, bool)
    gain, low = (float(x) for x in scheduler.drafting_gain(apart, act, table))
    assert low < gain < 0.0
    base = eng.init_state()._replace(a_hist=jnp.stack([apart] * 2), since_draft=jnp.int32(99), probe_gap=jnp.int32(8))
    for credit, probes in ((0.0, False), (-low - 1e-3, False), (-low + 1e-3, True)):
        pays, settled = round_mod._skip_decision(eng.spec, base._replace(probe_credit=jnp.float32(credit)), act, ctl, 9)
        assert bool(pays) is probes and bool(settled) is not probes, credit
    _, _, credit = round_mod._probe_schedule(eng.spec, base._replace(probe_credit=jnp.float32(1.0)), apart, act, ctl,
                                             0.0, 0.0)
    assert float(credit) == pytest.approx(1.0 + gain)


def test_known_speculation_pays_matches_numpy():
    rng = np.random.default_rng(3)
    tab = scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.4)
    tab_np = scheduler.make_table(BUCKETS, t_verify=(1.0, 1.15, 2.2), t_draft=0.4, as_numpy=True)
    seen = set()
    for _ in range(60):
        a = np.cumprod(rng.uniform(0, 1, (3, 3)) ** rng.uniform(0.2, 3), axis=1)
        act = rng.random(3) < 0.8
        for mode in ("sps", "latency"):
            want = numpy_ref.known_speculation_pays_np(a, act, tab_np, mode=mode)
            assert bool(scheduler.known_speculation_pays(a, act, tab, mode=mode)) == want
            seen.add(want)
    assert seen == {True, False}


def test_scheduled_policies_refuse_to_guess(setup):
    """No made-up tables, mismatched buckets or fake survivals: each is one clear error (these
    engines used to run on an invented table, a table for other batch sizes, or survivals 0.5^j)."""
    from dspark_jax.engine import EngineError

    target, prompts, _ = setup
    d = tiny_drafter("dspark", target, gamma=3)
    for kw in ({"policy": "early_stop"}, {"policy": "production"}, {"skip_drafting": "best_case"}):
        kw = {"policy": "fixed", "own_costs": False, **kw}  # an engine that does not measure its own
        eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,), **kw))
        with pytest.raises(EngineError, match="cost table and none was given.*costs measure"):
            eng.generate(prompts, max_new_tokens=4, sampling=GREEDY)
    # with a table each runs (test_scheduler_in_compiled_round, test_skip_on_known_survivals...);
    # a fixed policy never needs one (every other engine test)

    eng = Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, prefill_buckets=(20,),
                                         policy="early_stop"))
    for other in ((2, 4, 12), (3, 6), (3, 6, 12, 24)):
        with pytest.raises(EngineError,
                           match=r"buckets .* do not match this engine's verification buckets \[3, 6, 12\]"):
            eng.generate(prompts, max_new_tokens=4, sampling=GREEDY,
                         table=scheduler.make_table(other, t_verify=np.linspace(1, 2, len(other))))
    with pytest.raises(EngineError, match="do not match"):
        Engine(target, d, EngineConfig(num_slots=3, max_len=40, buckets=BUCKETS, policy="static"),
               table=scheduler.make_table((4, 12), t_verify=(1.0, 2.0)))

    for kind in ("dflash", "eagle3", "mtp1"):
        nc = tiny_drafter(kind, target, gamma=3)
        lk = dict(layer_ids=[0]) if kind == "eagle3" else {}
        for kw in ({"policy": "early_stop"}, {"policy": "threshold"}, {"skip_drafting": "known"}):
            with pytest.raises(EngineError, match=f"confidence head, and this {kind} drafter has none"):
                Engine(target, nc, EngineConfig(num_slots=3, max_len=40, **lk, **{"policy": "fixed", **kw}))
        Engine(target, nc, EngineConfig(policy="fixed", num_slots=3, max_len=40, skip_drafting="best_case",
                                        **lk))  # reads the table only
