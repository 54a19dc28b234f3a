"""Batched KV-cache sampling against an independent no-cache argmax loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.parallel.sharding import create_model
from dspark_jax.target import TargetModel
from dspark_jax.target.generation import _generate_jit, generate, generate_host_loop

N = 8  # max new tokens
P = 6  # padded prompt length
LENS = np.array([6, 2, 4])


@pytest.fixture(scope="module")
def prompts(micro_cfg):
    v = micro_cfg.target.model.vocab_size
    toks = np.array(jax.random.randint(jax.random.key(3), (3, P), 5, v), np.int32)
    toks[np.arange(P)[None, :] >= LENS[:, None]] = 0  # right padding
    return toks


@pytest.fixture(scope="module")
def reference(micro_target):
    """Greedy continuation recomputing the full causal forward (no cache) for every token."""
    graphdef, state = nnx.split(micro_target)

    @jax.jit
    def next_token(state, buf, cur):
        logits = nnx.merge(graphdef, state)(buf).logits  # [R, L, V]
        return jnp.argmax(logits[jnp.arange(buf.shape[0]), cur - 1], axis=-1)

    def run(prompts, lens, steps):
        buf = np.zeros((len(lens), P + N), np.int32)
        buf[:, :P] = prompts
        cur = np.array(lens)
        out = np.zeros((len(lens), steps), np.int32)
        for s in range(steps):
            t = np.asarray(next_token(state, buf, cur))
            out[:, s] = t
            buf[np.arange(len(lens)), cur] = t
            cur = cur + 1
        return out

    return run


def test_greedy_equals_no_cache_argmax(micro_target, prompts, reference):
    out = generate(micro_target, prompts, LENS, max_new_tokens=N, sampling=SamplingParams(0.0, 0, 1.0))
    np.testing.assert_array_equal(np.asarray(out.tokens), reference(prompts, LENS, N))
    np.testing.assert_array_equal(np.asarray(out.lengths), [N] * 3)


def test_stop_token_and_per_row_max_new(micro_target, prompts, reference):
    ref = reference(prompts, LENS, N)
    stop = int(ref[0, 3])
    first = [int(np.argmax(row == stop)) + 1 if np.any(row == stop) else N for row in ref]
    max_new = np.array([N, 5, 0])
    out = generate(micro_target, prompts, LENS, max_new_tokens=N, sampling=SamplingParams(0.0, 0, 1.0),
                   stop_ids=(stop,), max_new=max_new, pad_id=-7)
    toks, lens = np.asarray(out.tokens), np.asarray(out.lengths)
    want = np.minimum(first, max_new)
    np.testing.assert_array_equal(lens, want)
    assert lens[0] == first[0] <= 4 and toks[0, lens[0] - 1] == stop
    for r in range(3):
        np.testing.assert_array_equal(toks[r, :lens[r]], ref[r, :lens[r]])
        assert np.all(toks[r, lens[r]:] == -7)


def test_host_loop_matches_compiled_loop_when_sampling(micro_target, prompts):
    kw = dict(max_new_tokens=N, sampling=SamplingParams(0.9, 40, 0.95), seed=11, sample_index=[4, 9, 2])
    a = generate(micro_target, prompts, LENS, **kw)
    b = generate_host_loop(micro_target, prompts, LENS, **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))


def test_rows_depend_on_sample_index_not_slot(micro_target, prompts):
    sp = SamplingParams(1.0, 0, 1.0)
    a = generate(micro_target, prompts, LENS, max_new_tokens=N, sampling=sp, seed=5, sample_index=[10, 11, 12])
    perm = np.array([2, 0, 1])
    b = generate(micro_target, prompts[perm], LENS[perm], max_new_tokens=N, sampling=sp, seed=5,
                 sample_index=np.array([10, 11, 12])[perm])
    np.testing.assert_array_equal(np.asarray(a.tokens)[perm], np.asarray(b.tokens))
    c = generate(micro_target, prompts, LENS, max_new_tokens=N, sampling=sp, seed=5, sample_index=[10, 11, 13])
    ta, tc = np.asarray(a.tokens), np.asarray(c.tokens)
    np.testing.assert_array_equal(ta[:2], tc[:2])
    assert not np.array_equal(ta[2], tc[2])  # another index, another stream


def test_sampling_settings_are_traced(micro_target, prompts):
    generate(micro_target, prompts, LENS, max_new_tokens=N, sampling=SamplingParams(0.5, 10, 0.9))
    n = _generate_jit._cache_size()
    generate(micro_target, prompts, LENS, max_new_tokens=N, sampling=SamplingParams(1.3, 3, 0.5), stop_ids=(1,))
    assert _generate_jit._cache_size() == n


def test_bad_input_is_named(micro_target, prompts):
    with pytest.raises(ValueError, match="prompt_lens"):
        generate(micro_target, prompts, [0, 1, 1], max_new_tokens=N)
    with pytest.raises(ValueError, match="max_new"):
        generate(micro_target, prompts, LENS, max_new_tokens=N, max_new=N + 1)


def test_per_layer_decode_path_gives_the_same_tokens(micro_cfg, prompts, reference, monkeypatch):
    """Where the engine's programs run the layers over per-layer weights (accelerators), so does
    generation: forced here on the CPU (on a fresh copy of the session's model, which the split
    changes), the greedy tokens still equal the no-cache reference, the model holds the per-layer
    split afterwards (one copy of the weights), and a second call over it gives the same tokens."""
    import dspark_jax.target.generation as generation

    monkeypatch.setattr(generation, "per_layer_decode", lambda mesh=None: True)
    seen = []
    real = generation.decode_arrays
    monkeypatch.setattr(generation, "decode_arrays", lambda *a, **k: seen.append(k) or real(*a, **k))
    model = create_model(lambda: TargetModel(micro_cfg.target.model, rngs=nnx.Rngs(0)))  # as micro_target
    greedy = SamplingParams(0.0, 0, 1.0)
    out = generate(model, prompts, LENS, max_new_tokens=N, sampling=greedy)
    np.testing.assert_array_equal(np.asarray(out.tokens), reference(prompts, LENS, N))
    assert seen == [{"per_layer": True, "hold": True}]
    assert isinstance(model.arrays()["layers"], tuple)  # held per layer: the stacks are gone
    again = generate(model, prompts, LENS, max_new_tokens=N, sampling=greedy)
    np.testing.assert_array_equal(np.asarray(again.tokens), np.asarray(out.tokens))
