"""Under a skip rule a host loop runs each round's own program (`Engine.step`): the skip rule's
choice (`round.round_choice`), then the plain round, the settled round or the drafting round.

What that buys is checked on the compiled programs: the settled round is the target-only
engine's round by the compiler's count (with chunked prefill too, where it used to run the
drafter over every round's chunk), and the choice each round hands the next is the one asking
again would give."""

from __future__ import annotations

import collections

import jax
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.batcher import Batcher, Job
from dspark_jax.engine.round import ROUND_DRAFTING, ROUND_SETTLED
from dspark_jax.engine.timing import prefilled_state
from dspark_jax.scheduler import make_table
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

GREEDY = SamplingParams(0.0, 0, 1.0)


@pytest.fixture(scope="module")
def target():
    return tiny_target(tiny_config(vocab_size=64, hidden_size=32, num_layers=4), logit_scale=1.0)


def _flops(program, *args) -> float:
    cost = program.jitted.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return float(cost["flops"])


@pytest.mark.parametrize("chunk", [None, 8])
def test_the_settled_round_is_the_target_only_round(target, chunk):
    """The compiled settled round does the target-only round's arithmetic (within 2 %), the plain
    round that keeps the drafter's context more, the drafting round more still."""
    cfg = dict(num_slots=4, max_len=64, prefill_buckets=(16,), prefill_chunk=chunk, buckets=(4, 8, 16, 24))
    ar = Engine(target, None, EngineConfig(**cfg))
    eng = Engine(target, tiny_drafter("dspark", target, gamma=3),
                 EngineConfig(**cfg, skip_drafting="known", own_costs=False))
    programs = eng.round_programs()
    assert set(programs) == {"plain", "settled", "drafting"}
    ctl = eng.control(GREEDY, table=eng.unpriced_table)
    st = eng.init_state()
    flops = {name: _flops(p, eng.tp, eng.dp, st, ctl) for name, p in programs.items()}
    target_only = _flops(ar._round, ar.tp, ar.dp, ar.init_state(), ar.control(GREEDY))
    assert flops["settled"] == pytest.approx(target_only, rel=0.02), (flops, target_only)
    assert flops["plain"] > 1.02 * target_only
    assert flops["drafting"] > 1.3 * flops["plain"]


def test_each_round_hands_the_next_the_choice_asking_again_gives(target):
    """Rounds served through a Batcher (joins, ends, a table that changes between rounds): each
    round drafts exactly when the skip rule's choice on the state it started from says so, and
    the choice a round hands the next (the settled round's included, which asks again only when
    the decoding slots changed) is the one asking again gives."""
    eng = Engine(target, tiny_drafter("dspark", target, gamma=3),
                 EngineConfig(num_slots=2, max_len=64, prefill_buckets=(16,), skip_drafting="known",
                              probe_every=2, probe_max=4, own_costs=False))
    cheap = make_table(eng.priced_buckets, t_verify=np.linspace(1.0, 1.2, len(eng.priced_buckets)), t_draft=0.01)
    dear = make_table(eng.priced_buckets, t_verify=np.linspace(1.0, 3.0, len(eng.priced_buckets)), t_draft=5.0)
    b = Batcher(eng, eng.control(GREEDY, table=cheap), stream=True)
    rng = np.random.default_rng(0)
    pending = [Job(prompt=rng.integers(5, 60, 6).tolist(), max_new=int(rng.integers(3, 12)), sampling=GREEDY, seed=i)
               for i in range(6)]
    drafted, seen, handed = [], set(), set()
    for i in range(200):
        if pending and b.free_slots():
            taken, _ = b.admit(collections.deque([pending.pop(0)]))
            b.join(taken)
        if not b.busy:
            break
        if i % 7 == 3:  # new controls: the cached choice must not be used
            b.control = b.control._replace(table=dear if i % 2 else cheap)
        want = int(eng._choose(b.state, b.control)) == ROUND_DRAFTING  # not donated: the state stays
        rnd = b.round()
        drafted.append(rnd.drafted)
        assert rnd.drafted is want, i
        seen.add(want)
        last_state, last_ctl, chosen = eng._next_round
        if last_state is b.state and last_ctl is b.control:  # what the next round will read
            assert int(chosen) == int(eng._choose(b.state, b.control)), i
            handed.add(int(chosen))
    assert seen == {True, False} and not pending
    assert {ROUND_SETTLED, ROUND_DRAFTING} <= handed, handed  # the settled round asks again only on a change


def test_a_timed_state_copy_asks_again(target):
    """A state the round did not return (a copy, as the timers make) is asked about again."""
    eng = Engine(target, tiny_drafter("dspark", target, gamma=3),
                 EngineConfig(num_slots=2, max_len=64, prefill_buckets=(16,), skip_drafting="known", own_costs=False))
    from dspark_jax.engine.state import PIN_SKIP

    st = prefilled_state(eng, 2, prompt=10)
    drafting, skipping = eng.control(GREEDY, pin=eng.G, table=eng.unpriced_table), \
        eng.control(GREEDY, pin=PIN_SKIP, table=eng.unpriced_table)
    st, out = eng.step(jax.tree.map(lambda x: x.copy(), st), drafting)
    assert bool(out.drafted)
    st, out = eng.step(st, skipping)  # the same state, other controls
    assert not bool(out.drafted)


def test_a_settled_round_asks_again_when_a_slot_ends(target):
    """A settled "no" taken at two slots holds while two decode; the settled round in which one
    of them ends hands the next round a probe (the credit covers it), not another settled round."""
    import jax.numpy as jnp

    from dspark_jax.engine.round import ROUND_SETTLED

    eng = Engine(target, tiny_drafter("dspark", target, gamma=3),
                 EngineConfig(num_slots=2, max_len=64, prefill_buckets=(16,), skip_drafting="known", own_costs=False))
    table = make_table(eng.priced_buckets, t_verify=np.linspace(1.0, 1.2, len(eng.priced_buckets)), t_draft=0.3)
    ctl = eng.control(GREEDY, table=table)
    low = jnp.full((2, 2, eng.spec.Gs), 0.05, jnp.float32)
    st = prefilled_state(eng, 2, prompt=10)._replace(a_hist=low, probe_gap=jnp.int32(-2), since_draft=jnp.int32(99),
                                                      probe_credit=jnp.float32(100.0), max_new=jnp.array([40, 1]))
    assert int(eng._choose(st, ctl)) == ROUND_SETTLED
    new, out, chosen = eng.round_programs()["settled"](eng.tp, eng.dp, st, ctl)
    assert not bool(new.active[1]) and bool(new.active[0])
    assert int(chosen) == int(eng._choose(new, ctl)) == ROUND_DRAFTING
