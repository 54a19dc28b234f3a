"""The Batcher, the one continuous-batching loop: more requests than slots, streamed updates,
cancellation (slot and pages back at once), and what it refuses."""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Batcher, Engine, EngineConfig, Job
from dspark_jax.testing.tiny import tiny_drafter

SAMPLED = SamplingParams(1.0, 0, 1.0)
MAX_NEW = 9


@pytest.fixture(scope="module")
def engine(target):
    config = EngineConfig(policy="fixed",
                          num_slots=2, max_len=40, buckets=(8,), prefill_buckets=(16,), kv_pages=(30, 4))
    return Engine(target, tiny_drafter("dspark", target, gamma=3), config)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(0, 15, n).tolist() for n in (5, 12, 3, 8, 6)]


def _key(seed: int, index: int) -> np.ndarray:
    """The key `Engine.generate` gives request `index` of a call with `seed`."""
    return np.asarray(jax.random.key_data(jax.random.fold_in(jax.random.key(seed), jnp.uint32(index))))


def _jobs(prompts, seed=5):
    return [Job(prompt=p, max_new=MAX_NEW, sampling=SAMPLED, key_data=_key(seed, i), id=i)
            for i, p in enumerate(prompts)]


def test_more_requests_than_slots_equal_each_request_alone(engine, prompts):
    """5 sampled requests through 2 slots, streamed: each one's tokens equal the request
    generated alone with the same key; the streamed pieces add up to them; each ends once, and
    every slot and page is free at the end."""
    b = Batcher(engine, engine.control(SAMPLED))
    jobs = _jobs(prompts)
    streamed, ends, rounds = collections.defaultdict(list), collections.Counter(), []
    most_busy = 0

    def on_round(rnd):
        nonlocal most_busy
        most_busy = max(most_busy, int((rnd.ids >= 0).sum()))
        rounds.append(rnd)
        for u in rnd.updates:
            streamed[u.job.id] += u.new
            ends[u.job.id] += u.reason is not None

    b.run(jobs, on_round=on_round)
    assert most_busy == 2 and len(rounds) == b.calls
    for i, (p, job) in enumerate(zip(prompts, jobs)):
        alone = engine.generate([p], max_new_tokens=MAX_NEW, sampling=SAMPLED, seed=5, sample_index=[i]).results[0]
        assert job.tokens == alone.tokens and job.finish_reason == alone.finish_reason, i
        assert streamed[i] == job.tokens and ends[i] == 1
        assert job.rounds == alone.rounds and job.accepted == alone.accepted
    assert not b.busy and engine.pages.pages_in_use == 0 and engine.pages.reserved.sum() == 0


def test_generate_is_the_batcher(engine, prompts):
    """`Engine.generate` runs the same loop: its results equal the batcher's jobs."""
    jobs = _jobs(prompts, seed=2)
    Batcher(engine, engine.control(SAMPLED), stream=False).run(jobs)
    res = engine.generate(prompts, max_new_tokens=MAX_NEW, sampling=SAMPLED, seed=2)
    assert [r.tokens for r in res.results] == [j.tokens for j in jobs]


def test_cancel_frees_the_slot_and_its_pages(engine, prompts):
    """A cancelled request stops decoding at once: its slot holds nothing, its pages and its
    reservation are back in the pool, and the request beside it still gets its own tokens."""
    b = Batcher(engine, engine.control(SAMPLED))
    keep, drop = _jobs(prompts[:2])
    taken, refused = b.admit(collections.deque([keep, drop]))
    assert [s for s, _ in taken] == [0, 1] and not refused
    b.join(taken)
    b.round()
    assert engine.pages.owned[1] > 0 and engine.pages.reserved[1] > 0
    assert b.cancel(drop.id) is drop and drop.finish_reason == "cancelled"
    assert b.slots[1] is None and engine.pages.owned[1] == 0 and engine.pages.reserved[1] == 0
    assert not bool(np.asarray(b.state.active)[1])
    assert b.cancel(drop) is None  # not running any more
    while b.busy:
        assert all(u.job is keep for u in b.round().updates)
    alone = engine.generate(prompts[:1], max_new_tokens=MAX_NEW, sampling=SAMPLED, seed=5).results[0]
    assert keep.tokens == alone.tokens
    assert engine.pages.pages_in_use == 0 and engine.pages.reserved.sum() == 0


def test_the_head_of_the_queue_waits_for_pages_and_too_large_is_refused(target, prompts):
    """A pool that holds one request's reach: the second waits (nothing taken) until the first
    ends; a request larger than the whole pool is refused, not queued forever."""
    config = EngineConfig(policy="fixed", num_slots=2, max_len=40, buckets=(8,), prefill_buckets=(16,), kv_pages=(6, 4))
    eng = Engine(target, tiny_drafter("dspark", target, gamma=3), config)
    b = Batcher(eng, eng.control(SAMPLED))
    first, second = _jobs(prompts[:2])
    pending = collections.deque([first, second])
    taken, _ = b.admit(pending)
    assert [j for _, j in taken] == [first] and list(pending) == [second]
    huge = Job(prompt=prompts[0], max_new=30, sampling=SAMPLED)
    taken, refused = b.admit(collections.deque([huge]))
    assert not taken and refused and refused[0][0] is huge and "whole pool" in str(refused[0][1])


def test_a_join_waits_for_its_work_so_a_round_times_only_itself(engine, prompts, monkeypatch):
    """The join's prefill is dispatched asynchronously; the batcher waits for it, so the next
    round's seconds (what the live cost table observes) do not carry it. The engine's join here
    hands back its state behind a slow program (a chain of 512 x 512 products, values unchanged):
    without the wait a leaf of the state is still being computed when `join` returns."""

    def chain(y):
        return jax.lax.fori_loop(0, 200, lambda _, a: jnp.tanh(a @ a) * 0.5, y)

    slow = jax.jit(lambda x, y: x + (jnp.sum(chain(y)) * 0).astype(x.dtype))
    y = jnp.full((512, 512), 1e-3, jnp.float32)
    slow(jnp.zeros(3), y).block_until_ready()  # compiled before the join
    real_start = engine.start

    def start(state, control, *args):
        state, control = real_start(state, control, *args)
        leaves, tree = jax.tree.flatten(state)
        return jax.tree.unflatten(tree, [slow(leaves[0], y), *leaves[1:]]), control

    monkeypatch.setattr(engine, "start", start)
    b = Batcher(engine, engine.control(SAMPLED))
    taken, _ = b.admit(collections.deque(_jobs(prompts)[:engine.R]))
    b.join(taken)
    arrays = [x for x in jax.tree.leaves(b.state) if not jnp.issubdtype(x.dtype, jax.dtypes.prng_key)]
    assert all(x.is_ready() for x in arrays), "the join returned before its work ended"
    assert b.join_seconds > 0 and b.calls == 0
    b.run([])  # the joined jobs run to their ends on the state the join made
    assert all(j is None for j in b.slots)
