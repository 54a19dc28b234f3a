"""One copy of the target's weights on the devices: an engine that splits the layers per layer (as
compiled for an accelerator, forced here on the CPU) leaves its model holding that split instead
of its stacks, a second engine adds no weights, target-only generation holds them once while it
runs, `plan engine` counts what a built engine holds,
and `bench roofline` holds one engine and one decode state at a time.

The model is scaled so that one copy of its decoder layers outweighs everything else a check
allows for (states, controls, the drafter): a second copy of the layers fails each check, and
each test first shows that its measurement sees the copy (the split kept beside the stacks)."""

import dataclasses
import gc

import jax
import pytest

from dspark_jax.bench.roofline_measure import measure_programs
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine import engine as engine_mod
from dspark_jax.target import decode_weights, generation
from dspark_jax.target.config import ModelConfig
from dspark_jax.testing.tiny import tiny_drafter, tiny_target

# 4 layers of 3 MB (float32) against a 0.5 MB embedding and caches of about 0.5 MB
SCALED = ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4,
                     num_kv_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=512)
CONFIG = EngineConfig(policy="fixed", num_slots=2, max_len=64, prefill_buckets=(16,))


def live() -> int:
    gc.collect()
    return sum(int(a.nbytes) for a in jax.live_arrays())


def nbytes(tree) -> int:
    """Bytes of the arrays (or shapes) of `tree`."""
    return sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(tree))


@pytest.fixture
def per_layer(monkeypatch):
    """The engine's programs over per-layer weights, as compiled for an accelerator."""
    monkeypatch.setattr(engine_mod, "per_layer_decode", lambda mesh=None: True)


@pytest.fixture
def copying(monkeypatch):
    """The broken variant: the engine splits the layers and the model keeps its stacks."""
    real = decode_weights.decode_arrays
    monkeypatch.setattr(engine_mod, "decode_arrays", lambda *a, **k: real(*a, **{**k, "hold": False}))


def _grown_by_engines(make_state: bool):
    """(bytes the layers take, bytes two engines and a decode state added to the live arrays,
    the state's bytes)."""
    model = tiny_target(SCALED, logit_scale=1.0)
    layers = nbytes(model.layers.arrays())
    before = live()
    first = Engine(model, None, CONFIG)
    second = Engine(model, None, CONFIG)
    st = first.init_state() if make_state else None
    grown = live() - before
    assert second.tp is not None
    return layers, grown, nbytes(st)


def test_the_measure_sees_a_second_copy(per_layer, copying):
    layers, grown, _ = _grown_by_engines(make_state=False)
    assert grown >= 2 * layers * 0.95  # each engine split its own copy


def test_engines_and_model_hold_the_layers_once(per_layer):
    layers, grown, state = _grown_by_engines(make_state=True)
    assert layers > 10 * state
    # a decode state and the engines' small arrays (controls, tables), no copy of the layers
    assert grown < state + layers / 10, (grown, state, layers)


def _live_while_generating(monkeypatch, hold: bool) -> tuple[int, int]:
    """(the layers' bytes, the bytes the model and generation add to the live arrays while the
    compiled decode loop runs) for `generate` with per-layer weights forced, the split held by the
    model (`hold`) or copied beside its stacks (the broken variant)."""
    monkeypatch.setattr(generation, "per_layer_decode", lambda mesh=None: True)
    real_split, real_loop = generation.decode_arrays, generation._generate_jit
    monkeypatch.setattr(generation, "decode_arrays", lambda *a, **k: real_split(*a, **{**k, "hold": hold}))
    seen = []
    monkeypatch.setattr(generation, "_generate_jit", lambda *a, **k: seen.append(live()) or real_loop(*a, **k))
    before = live()
    model = tiny_target(SCALED, logit_scale=1.0)
    layers = nbytes(model.layers.arrays())
    prompts = jax.numpy.ones((2, 8), jax.numpy.int32)
    generation.generate(model, prompts, [8, 8], max_new_tokens=4, sampling=SamplingParams(0.0, 0, 1.0))
    return layers, seen[0] - before


def test_generation_holds_the_layers_once(monkeypatch):
    layers, during = _live_while_generating(monkeypatch, hold=True)
    assert during < 1.2 * layers, (during, layers)


def test_the_generation_measure_sees_a_second_copy(monkeypatch):
    layers, during = _live_while_generating(monkeypatch, hold=False)
    assert during >= 1.9 * layers, (during, layers)


def test_plan_counts_what_an_engine_holds(per_layer):
    """`plan engine`'s held bytes (the weights once and one decode state) against the live
    arrays a target model, an engine on it and a fresh state add on this device."""
    from dspark_jax.config import from_cli
    from dspark_jax.engine.plan import plan

    cfg = from_cli(["micro"])
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, model=SCALED, dtype="float32"))
    res = plan(cfg, CONFIG.num_slots, CONFIG.max_len, (1, 1, 1), drafter=False)
    held = res["target_weights"] + res["decode_state"]
    before = live()
    model = tiny_target(SCALED, logit_scale=1.0)
    eng = Engine(model, None, CONFIG)
    st = eng.init_state()
    grown = live() - before
    assert res["decode_state"] == nbytes(st)
    assert res["target_weights"] == nbytes(eng.tp)
    assert held <= grown < held + res["decode_state"] / 4, (grown, held)


def _roofline(slots: int = 2, context: int = 64):
    """(bytes alive before, each program's `live_bytes`, the drafter's own weights, one decode
    state's bytes, the layers' bytes) of `measure_programs` on the scaled model."""
    model = tiny_target(SCALED, logit_scale=1.0)
    drafter = tiny_drafter("dspark", model, gamma=3)
    layers = nbytes(model.layers.arrays())
    own = nbytes(jax.tree.leaves(drafter.arrays()))  # an upper bound of the engine's split of it
    state = nbytes(Engine(model, drafter, dataclasses.replace(CONFIG, num_slots=slots, max_len=context)).state_shape)
    before = live()
    res = measure_programs(model, drafter, slots=slots, context=context, fill=1.0, prompt=8, repeats=1,
                           say=lambda s: None)
    return before, res["live_bytes"], own, state, layers


def test_roofline_measure_sees_a_second_copy(per_layer, copying):
    before, after, own, state, layers = _roofline()
    assert max(after.values()) - before >= layers * 0.95  # the DSpark engine's own split


def test_roofline_holds_one_engine_and_one_state_at_a_time(per_layer):
    """After each program the device holds what it held before the measurement, plus the DSpark
    engine's drafter arrays while it lives: no second copy of the target's layers (the two
    engines share the model's), no decode state left from a program."""
    before, after, own, state, layers = _roofline()
    assert layers > own + state  # a copy of the layers exceeds what each program may add
    assert set(after) >= {"target_step", "draft", "prefill"} and any(k.startswith("round@") for k in after)
    assert after["target_step"] - before < state / 2, after
    for name, b in after.items():
        assert b - before < own + state / 2, (name, b - before, own, state)


def test_with_a_mesh_the_callers_model_holds_the_split(per_layer):
    """On a mesh the caller's model object is laid out in place and holds the engine's split
    (a laid-out copy of the model would leave the caller's stacks alive beside it), and the
    engine decodes what one off the mesh decodes."""
    from dspark_jax.parallel.sharding import make_mesh

    model = tiny_target(SCALED, logit_scale=1.0)
    layers = nbytes(model.layers.arrays())
    before = live()
    eng = Engine(model, None, CONFIG, mesh=make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert eng.target is model and model.layers.holds_per_layer
    assert model.arrays()["layers"][0]["down_proj"] is eng.tp["layers"][0]["down_proj"]
    assert live() - before < layers / 10
    prompts, sampling = [[1, 2, 3], [4, 5]], SamplingParams(0.0, 0, 1.0)
    plain = Engine(tiny_target(SCALED, logit_scale=1.0), None, CONFIG)  # the same weights, no mesh
    assert ([r.tokens for r in eng.generate(prompts, max_new_tokens=6, sampling=sampling).results]
            == [r.tokens for r in plain.generate(prompts, max_new_tokens=6, sampling=sampling).results])


def test_keep_target_stacks_leaves_the_model_as_it_was(per_layer):
    """The opt-out for a caller that runs arrays it took from the model before the engine: the
    stacks stay alive beside the engine's split."""
    model = tiny_target(SCALED, logit_scale=1.0)
    stacks = [getattr(model.layers, n)[...] for n in model.layers.names]
    eng = Engine(model, None, dataclasses.replace(CONFIG, keep_target_stacks=True))
    assert isinstance(eng.tp["layers"], tuple) and not model.layers.holds_per_layer
    assert not any(a.is_deleted() for a in stacks)
