"""A prefill of more prompt tokens than `prefill_tokens` goes in groups of rows (engine/round.py):
the same tokens as one forward over all rows, groups without a joining slot skipped, and the
compiled program's temporaries a group's, not the batch's."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine.round import prefill_group
from dspark_jax.testing.tiny import tiny_drafter

VOCAB = 16  # tests/engine/conftest.py's target


def test_group_size_is_the_largest_divisor_within_the_budget():
    assert prefill_group(64, 2048, 8192) == 4
    assert prefill_group(64, 16, 8192) == 64
    assert prefill_group(6, 100, 250) == 2
    assert prefill_group(7, 100, 250) == 1  # a prime number of rows: one at a time
    assert prefill_group(4, 10_000, 8192) == 1  # a prompt longer than the budget still prefills


@pytest.fixture(scope="module")
def engines(target):
    drafter = tiny_drafter("dspark", target)
    base = dict(num_slots=4, max_len=48, prefill_buckets=(16,))
    whole = Engine(target, drafter, EngineConfig(policy="fixed", **base))
    grouped = Engine(target, drafter, EngineConfig(policy="fixed", **base, prefill_tokens=32))  # 2 rows a group
    return whole, grouped


def test_grouped_prefill_gives_the_same_tokens(engines):
    whole, grouped = engines
    rng = np.random.default_rng(0)
    # three prompts: slots 0, 1 (group 0) and 2 (group 1); slot 3 idle
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (9, 16, 3)]
    for sp in (SamplingParams(0.0, 0, 1.0), SamplingParams(1.0, 0, 1.0)):
        a = whole.generate(prompts, max_new_tokens=12, sampling=sp, seed=3)
        b = grouped.generate(prompts, max_new_tokens=12, sampling=sp, seed=3)
        assert [r.tokens for r in a.results] == [r.tokens for r in b.results]


def test_grouped_prefill_caches_equal_the_whole_forward(engines):
    """The caches after prefilling slots 0 and 3 (groups 0 and 1, each with an idle slot): equal
    at the joined slots' prompt positions, target and drafter."""
    whole, grouped = engines
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, VOCAB, size=n).tolist() for n in (12, 7)]
    out = []
    for eng in (whole, grouped):
        st = eng.init_state()
        st = eng.prefill_slots(st, [0, 3], prompts, np.zeros((2, 2), np.uint32), [4, 4])
        out.append(st)
    for slot, p in zip((0, 3), prompts):
        n = len(p) - 1
        for name in ("cache", "dcache"):
            a, b = (np.asarray(getattr(o, name).k)[:, slot, :, :n] for o in out)
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
            assert np.abs(a).max() > 0  # written
    assert grouped.spec.prefill_tokens == 32 and prefill_group(4, 16, 32) == 2
