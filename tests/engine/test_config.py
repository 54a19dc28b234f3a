"""EngineConfig: one frozen value, checked once; each bad field is one error naming it. And the
engine's request validation (`Engine.validate_request`), shared by `generate` and the server."""

from __future__ import annotations

import dataclasses

import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.engine import Engine, EngineConfig, EngineError, InvalidRequest
from dspark_jax.engine.errors import EngineConfigError


@pytest.mark.parametrize("field,value,says", [
    ("num_slots", 0, "num_slots must be an integer >= 1"),
    ("num_slots", 2.5, "num_slots must be an integer"),
    ("num_slots", True, "num_slots must be an integer"),
    ("max_len", 2, "max_len must be an integer >= 3"),
    ("gamma", -1, "gamma must be an integer >= 0"),
    ("buckets", (), "buckets must be positive token counts"),
    ("prefill_buckets", (0, 16), "prefill_buckets must be positive"),
    ("buckets", ("a",), "buckets must be a sequence of integers"),
    ("policy", "greedy", "unknown length policy 'greedy'"),
    ("theta", "speed", "theta='speed'"),
    ("cost", "linear", "cost model 'linear'"),
    ("skip_drafting", "sometimes", "skip_drafting='sometimes'"),
    ("probe_every", 0, "1 <= probe_every <= probe_max"),
    ("probe_max", 4, "1 <= probe_every <= probe_max"),
    ("kv_pages", 4, "kv_pages must be a sequence"),
    ("kv_pages", (4,), "kv_pages must be \\(num_pages, page_size\\)"),
    ("kv_pages", (4, 0), "page_size >= 1"),
    ("paged_attention", "flash", "paged_attention 'flash' is not one of"),
    ("prefill_chunk", 0, "prefill_chunk must be an integer >= 1"),
    ("prefill_rows", 0, "prefill_rows must be an integer >= 1"),
])
def test_a_bad_field_is_one_error_naming_it(field, value, says):
    with pytest.raises(EngineConfigError, match=f"EngineConfig.*{says}"):
        EngineConfig(**{field: value})


def test_config_is_frozen_normalised_and_replaced_with_a_check():
    c = EngineConfig(policy="fixed", num_slots=3, buckets=[12, 3], kv_pages=[8, 4], layer_ids=[0])
    assert c.buckets == (12, 3) and c.kv_pages == (8, 4) and c.layer_ids == (0,)
    hash(c)  # usable as a key (tuples, not lists)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.num_slots = 4
    assert c.replace(num_slots=4).num_slots == 4 and c.num_slots == 3
    with pytest.raises(EngineConfigError, match="num_slots"):
        c.replace(num_slots=0)
    with pytest.raises(EngineConfigError, match="no field"):
        c.replace(slots=4)
    assert EngineConfig(policy="fixed",
                        skip_drafting=True).skip_rule == "known" and EngineConfig(policy="fixed").skip_rule is None


def test_the_engine_takes_a_config_and_checks_what_needs_the_models(target):
    with pytest.raises(EngineConfigError, match="takes an EngineConfig"):
        Engine(target, None, 4)
    with pytest.raises(EngineError, match="largest verification bucket 2 < num_slots"):
        Engine(target, None, EngineConfig(policy="fixed", num_slots=3, buckets=(2,)))
    eng = Engine(target, None, EngineConfig(policy="fixed", num_slots=2, max_len=20))
    assert eng.R == 2 and eng.S == 20 and eng.config.num_slots == 2


def test_validate_request_names_the_field(target):
    eng = Engine(target, None, EngineConfig(policy="fixed", num_slots=2, max_len=20, kv_pages=(3, 4)))
    ok = eng.validate_request([1, 2, 3], 4, sampling=SamplingParams(0.5, 10 ** 6, 1.0))
    assert ok.prompt == [1, 2, 3] and ok.sampling.top_k == 16  # top_k clamped to the vocabulary
    cases = [
        (([], 4), {}, "prompt", "0 tokens"),
        (([1] * 19, 1), {}, "prompt", "longer than the maximum context"),
        (([1, 16], 4), {}, "prompt", "outside the vocabulary 0..15"),
        (([1, 2], 0), {}, "max_tokens", "max_tokens must be an integer >= 1"),
        (([1, 2], 17), {"fit_context": True}, "max_tokens", "exceed the context of 18"),
        (([1, 2], 12), {}, "max_tokens", "whole pool of 3"),
        (([1, 2], 4), {"stop_ids": (99,)}, "stop", "stop ids in the vocabulary"),
        (([1, 2], 4), {"sampling": SamplingParams(float("nan"), 0, 1.0)}, "temperature", "temperature"),
        (([1, 2], 4), {"seed": 1.5}, "seed", "seed must be an integer"),
    ]
    for (prompt, max_new), kw, param, says in cases:
        with pytest.raises(InvalidRequest, match=says) as e:
            eng.validate_request(prompt, max_new, names={"max_new": "max_tokens"}, **kw)
        assert e.value.param == param, (prompt, max_new, kw)
