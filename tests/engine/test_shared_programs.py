"""Engines of the same shapes share their compiled programs within a process: a second engine
(another model of the same shapes, a new server or evaluation set) compiles nothing; an engine of
other shapes gets programs of its own; per-layer weights give the stacked forward's outputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.target.attention import cache_update
from dspark_jax.target.decode_weights import decode_arrays, unstack_layers
from dspark_jax.target.forward import forward
from dspark_jax.target.kv_cache import KVCache
from dspark_jax.testing.tiny import tiny_config, tiny_target

CONFIG = EngineConfig(policy="fixed", num_slots=2, max_len=32, buckets=(2,), prefill_buckets=(16,))


def test_second_engine_of_the_same_shapes_compiles_nothing(target):
    first = Engine(target, None, CONFIG)
    res1 = first.generate([[1, 2, 3], [4, 5]], max_new_tokens=6, sampling=SamplingParams(0.0, 0, 1.0))
    other = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), seed=7, logit_scale=1.0)
    second = Engine(other, None, CONFIG)
    assert second._round is first._round and second._prefill is first._prefill
    compiled = first._round._cache_size()
    res2 = second.generate([[1, 2, 3], [4, 5]], max_new_tokens=6, sampling=SamplingParams(0.0, 0, 1.0))
    assert first._round._cache_size() == compiled  # the other model's weights are arguments
    assert [r.tokens for r in res1.results] != [r.tokens for r in res2.results]  # its own weights were read
    longer = Engine(target, None, EngineConfig(policy="fixed",
                                               num_slots=2, max_len=48, buckets=(2,), prefill_buckets=(16,)))
    assert longer._round is not first._round


def test_per_layer_weights_equal_the_stacked_forward(target):
    arrays = target.arrays()
    split = decode_arrays(target)
    assert len(split["layers"]) == target.cfg.num_layers
    np.testing.assert_array_equal(split["layers"][1]["down_proj"], arrays["layers"]["down_proj"][1])
    tokens = jnp.asarray([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 5))
    valid = pos < jnp.asarray([[5], [3]])
    outs = []
    for params in (arrays, split):
        cache = KVCache.create(target.cfg, 2, 8)
        outs.append(forward(params, target.cfg, tokens, pos, cache_update(cache, pos, valid), feature_layers=(0,)))
    for a, b in zip(outs[0][:3], outs[1][:3]):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(outs[0].cache.k), np.asarray(outs[1].cache.k), rtol=1e-5, atol=1e-5)


def test_unstack_refuses_ragged_stacks():
    with pytest.raises(ValueError, match="disagree on the number of layers"):
        unstack_layers({"a": jnp.zeros((2, 3)), "b": jnp.zeros((3, 3))})


def test_engine_over_per_layer_weights_decodes_as_over_stacked(monkeypatch):
    """The engine as compiled for an accelerator (layers unrolled over per-layer weights: rounds,
    prefill, the packed verification views) gives the tokens of the stacked scan, greedy and
    sampled, DSpark and target-only."""
    from dspark_jax.engine import engine as engine_mod
    from dspark_jax.testing.tiny import tiny_drafter

    prompts = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]
    config = EngineConfig(policy="fixed", num_slots=2, max_len=40, prefill_buckets=(16,))

    def tokens(per_layer, d, sampling):
        monkeypatch.setattr(engine_mod, "per_layer_decode", lambda mesh=None: per_layer)
        # a model of its own (the same weights): a per-layer engine leaves its model holding the split
        own = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
        eng = Engine(own, None if d is None else tiny_drafter("dspark", own, gamma=3), config)
        assert isinstance(eng.tp["layers"], tuple) == per_layer
        res = eng.generate(prompts, max_new_tokens=10, sampling=sampling, seed=[3, 4, 5])
        return [r.tokens for r in res.results]

    for d in (None, "dspark"):
        for sampling in (SamplingParams(0.0, 0, 1.0), SamplingParams(1.0, 0, 1.0)):
            assert tokens(True, d, sampling) == tokens(False, d, sampling)


def test_per_layer_engine_leaves_its_model_reading_the_split(monkeypatch):
    """Where the engine splits the weights per layer, the model's stacked decoder weights are
    deleted once split and the model holds the engine's per-layer arrays (the same objects): it
    still runs, with the outputs it had, a second engine on it takes the split as it is, and
    both decode the tokens an engine over the stacked weights decodes."""
    from dspark_jax.engine import engine as engine_mod

    make = lambda: tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
    prompts, sampling = [[1, 2, 3, 4], [5, 6]], SamplingParams(0.0, 0, 1.0)
    keep = Engine(make(), None, CONFIG).generate(prompts, max_new_tokens=6, sampling=sampling)
    monkeypatch.setattr(engine_mod, "per_layer_decode", lambda mesh=None: True)
    model = make()
    stacks = [getattr(model.layers, n)[...] for n in model.layers.names]
    tokens = jnp.asarray([[3, 1, 4, 1, 5]], jnp.int32)
    before = np.asarray(model(tokens).logits)
    first = Engine(model, None, CONFIG)
    assert all(a.is_deleted() for a in stacks) and not model.embed[...].is_deleted()  # the drafter reads it
    assert model.layers.holds_per_layer
    held = model.arrays()["layers"]
    assert all(held[i][k] is first.tp["layers"][i][k] for i in range(len(held)) for k in held[i])
    np.testing.assert_allclose(np.asarray(model(tokens).logits), before, rtol=1e-5, atol=1e-5)
    second = Engine(model, None, CONFIG)
    assert all(a is b for a, b in zip(jax.tree.leaves(second.tp["layers"]), jax.tree.leaves(first.tp["layers"])))
    for eng in (first, second):
        res = eng.generate(prompts, max_new_tokens=6, sampling=sampling)
        assert [r.tokens for r in res.results] == [r.tokens for r in keep.results]
