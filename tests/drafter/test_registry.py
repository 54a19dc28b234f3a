"""The kind registry: every kind resolves, builds, round-trips and is found from its module; a
fifth kind is one adapter plus one registry entry, and then builds, saves, loads and decodes
losslessly through the unchanged engine."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DrafterSection
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.drafter import registry
from dspark_jax.drafter.frozen import attach_target
from dspark_jax.drafter.kinds.block import BlockKind
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.io import drafter_dir as drafter_io
from dspark_jax.parallel.sharding import create_model
from dspark_jax.testing.tiny import tiny_config, tiny_target

GREEDY = SamplingParams(0.0, 0, 1.0)


@pytest.fixture(scope="module")
def target():
    return tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)


def _dcfg(kind, target):
    return DrafterSection(kind=kind, num_layers=1, gamma=3, target_layer_ids=(0,), markov_rank=4,
                          mask_token_id=target.cfg.vocab_size - 1)


@pytest.mark.parametrize("name", list(registry.KINDS))
def test_every_kind_builds_and_is_found_from_its_module(target, name, tmp_path):
    d = create_model(lambda: registry.build(target.cfg, _dcfg(name, target), rngs=nnx.Rngs(0)))
    assert registry.kind_of(d) is registry.KINDS[name]
    assert d.dcfg == registry.resolve(target.cfg, d.dcfg)  # resolving is idempotent
    attach_target(d, target)
    drafter_io.save(d, tmp_path)
    assert registry.kind_of(drafter_io.load(tmp_path, target)) is registry.KINDS[name]


def test_unknown_kind_names_the_choices(target):
    with pytest.raises(ValueError, match="unknown drafter.kind 'medusa'; choose one of: dspark, dflash, eagle3, mtp1"):
        registry.build(target.cfg, _dcfg("medusa", target), rngs=nnx.Rngs(0))


class RepeatKind(BlockKind):
    """A fifth kind for the test: the block drafter's module, but every draft repeats the anchor
    (q is the point mass it was sampled from, so verification stays exact)."""

    name = "repeat"

    def draft(self, spec, dp, dcache, last, anchor, pos, keys, sampling, path):
        r, g, v = anchor.shape[0], spec.G, spec.tcfg.vocab_size
        toks = jnp.broadcast_to(anchor[:, None], (r, g)).astype(jnp.int32)
        return toks, jax.nn.one_hot(toks, v, dtype=jnp.float32), jnp.zeros((r, g), jnp.float32), dcache


def test_a_fifth_kind_is_one_adapter_and_one_registration(target, tmp_path, monkeypatch):
    repeat = RepeatKind()
    monkeypatch.setitem(registry.KINDS, repeat.name, repeat)
    d = create_model(lambda: registry.build(target.cfg, _dcfg("repeat", target), rngs=nnx.Rngs(0)))
    attach_target(d, target)
    drafter_io.save(d, tmp_path)
    d = drafter_io.load(tmp_path, target)
    assert registry.kind_of(d) is repeat
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 15, n).tolist() for n in (3, 9, 5)]
    plain = Engine(target, None, EngineConfig(policy="fixed", num_slots=3, max_len=40, prefill_buckets=(16,)))
    want = [r.tokens for r in plain.generate(prompts, max_new_tokens=12, sampling=GREEDY).results]
    eng = Engine(target, d, EngineConfig(policy="fixed", num_slots=3, max_len=40, prefill_buckets=(16,)))
    assert eng.spec.kind is repeat
    res = eng.generate(prompts, max_new_tokens=12, sampling=GREEDY)
    assert [r.tokens for r in res.results] == want  # lossless through the unchanged round
    # and it is the adapter that drafts: the engine's draft of a started batch repeats each anchor
    st = eng.prefill_slots(eng.init_state(), [0, 1, 2], prompts, np.asarray(jax.random.key_data(
        jax.random.split(jax.random.key(0), 3))), [12] * 3)
    toks, q, _ = eng.draft(st, eng.control(GREEDY))
    np.testing.assert_array_equal(np.asarray(toks), np.repeat(np.asarray(st.anchor)[:, None], 3, axis=1))
    np.testing.assert_array_equal(np.asarray(q).argmax(-1), np.asarray(toks))


def test_an_incomplete_kind_cannot_be_made():
    from dspark_jax.drafter.kinds.recurrent import RecurrentKind

    class Half(RecurrentKind):  # says nothing about how to draft
        name = "half"

    with pytest.raises(TypeError, match="abstract"):
        Half()
