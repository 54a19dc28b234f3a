"""Batched == per-request with the same keys; inactive / padded slots stay finite and inert; bad input."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.drafter.frozen import TargetMismatchError
from dspark_jax.engine import Engine, EngineConfig, EngineError
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

SAMPLED = SamplingParams(1.0, 0, 1.0)


@pytest.fixture(scope="module")
def engine(target):
    return Engine(target, tiny_drafter("dspark", target, gamma=3), EngineConfig(policy="fixed",
                                                                                num_slots=3, max_len=40, buckets=(12,),
                                                                                prefill_buckets=(20,)))


def test_batched_equals_per_request(engine):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 15, n).tolist() for n in (4, 11, 6, 2, 8)]
    both = engine.generate(prompts, max_new_tokens=10, sampling=SAMPLED, seed=3)
    for i, p in enumerate(prompts):  # alone: the other two slots stay inactive
        one = engine.generate([p], max_new_tokens=10, sampling=SAMPLED, seed=3, sample_index=[i])
        assert one.results[0].tokens == both.results[i].tokens
        assert one.results[0].rounds == both.results[i].rounds


def test_inactive_slots_finite_and_inert(engine):
    st = engine.init_state()
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 1)))
    st = engine.prefill_slots(st, [1], [[3, 4, 5]], kd, [6])
    ctl = engine.control(SAMPLED)
    for _ in range(3):
        st, ro = engine.step(st, ctl)
        assert not np.asarray(ro.active)[[0, 2]].any()
        assert int(ro.n_out[0]) == 0 and int(ro.n_out[2]) == 0
    for leaf in jax.tree.leaves(st.cache) + jax.tree.leaves(st.dcache):
        assert np.isfinite(np.asarray(leaf, np.float64)).all()
    assert int(st.n_gen[0]) == 0 and int(st.n_gen[2]) == 0 and int(st.n_gen[1]) == 6


def test_stop_ids_end_requests(engine):
    res = engine.generate([[1, 2, 3]], max_new_tokens=30, sampling=SAMPLED, seed=0)
    toks = res.results[0].tokens
    stop = toks[4]
    res2 = engine.generate([[1, 2, 3]], max_new_tokens=30, sampling=SAMPLED, seed=0, stop_ids=[stop])
    first = toks.index(stop)
    assert res2.results[0].tokens == toks[: first + 1]


# ---------------------------------------------------------------- bad input


def test_drafter_for_another_target(target):
    other = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), seed=9)
    d = tiny_drafter("dspark", other, gamma=3)
    with pytest.raises(TargetMismatchError, match="different target"):
        Engine(target, d, EngineConfig(policy="fixed", num_slots=2, max_len=32))


def test_gamma_above_compiled_max(engine, target):
    with pytest.raises(EngineError, match="gamma 5 is outside this engine's compiled range 0..3"):
        engine.generate([[1, 2]], max_new_tokens=4, gamma=5)
    with pytest.raises(EngineError, match="exceeds the drafter's block size 3"):
        Engine(target, tiny_drafter("dspark", target, gamma=3), EngineConfig(policy="fixed",
                                                                             num_slots=2, max_len=32, gamma=4))


def test_prompt_longer_than_context(engine):
    with pytest.raises(EngineError, match="prompt 1 has 40 tokens, longer than the maximum context"):
        engine.generate([[1, 2], [3] * 40], max_new_tokens=4)


def test_malformed_prompts_jsonl(tmp_path, capsys):
    from dspark_jax.commands.generate import main

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["hi"]}) + "\n" + "{not json\n")
    assert main(["--prompts", str(f), "--target", str(tmp_path / "none")]) == 2
    assert f"{f}:2" in capsys.readouterr().err


def test_engine_draft_is_the_rounds_draft():
    """Engine.draft (used by the cost tables) proposes exactly what the next round drafts."""
    import jax

    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2))
    eng = Engine(target, tiny_drafter("dspark", target, gamma=3), EngineConfig(policy="fixed", num_slots=2, max_len=24,
                                                                               prefill_buckets=(8,)))
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(1), 2)))
    st = eng.prefill_slots(eng.init_state(), [0, 1], [[1, 2, 3], [4, 5]], kd, [8, 8])
    ctl = eng.control(SamplingParams(1.0, 0, 1.0))
    toks, q, z = eng.draft(st, ctl)
    assert toks.shape == (2, 3) and q.shape == (2, 3, 16)
    _, ro = eng.step(st, ctl)
    np.testing.assert_allclose(np.asarray(ro.z), np.asarray(z), rtol=1e-6)
