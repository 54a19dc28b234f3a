"""The engine as it runs on a TPU, on this CPU: the drafter's decode layout (layers per layer and
merged, the feature projection and the Markov W1 laid out for decoding, drafter/decode_weights.py),
the draft's rows padded to the TPU's 8-row tile (the backbone's block padded with slots no query
sees, the head's rows padded with copies of row 0) and the cache read by the attention kernel
(interpreted here). Greedy and sampled drafts must give the tokens of the plain CPU layout, and the
engine must verify in the cheapest bucket its cost table prices."""

import numpy as np
import pytest

from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.drafter import backbone
from dspark_jax.drafter.kinds import block
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.engine import engine as engine_mod
from dspark_jax.scheduler import prefix
from dspark_jax.testing.tiny import tiny_drafter

PROMPTS = [[1, 2, 3, 4], [5, 6], [7, 8, 9, 10, 11, 12]]


def _run(target, drafter, sampling, monkeypatch, tpu: bool, slots: int = 1, max_len: int = 40):
    """(generated tokens, a draft's tokens / q / z after prefill) of an engine laid out for a TPU
    (`tpu`) or for this CPU."""
    import jax

    monkeypatch.setattr(engine_mod, "per_layer_decode", lambda mesh=None: tpu)
    monkeypatch.setattr(backbone, "row_tile", lambda mesh=None: 8 if tpu else 1)
    monkeypatch.setattr(block, "row_tile", lambda mesh=None: 8 if tpu else 1)
    eng = Engine(target, drafter, EngineConfig(policy="fixed", num_slots=slots, max_len=max_len, prefill_buckets=(16,),
                                               paged_attention="pallas"))
    assert isinstance(eng.dp["layers"], tuple) == tpu
    if tpu:
        assert "qkv_proj" in eng.dp["layers"][0] and "k_proj" in eng.dp["layers"][0]  # merged, k / v kept
    res = eng.generate(PROMPTS, max_new_tokens=10, sampling=sampling, seed=[3, 4, 5])
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), slots)))
    st = eng.prefill_slots(eng.init_state(), list(range(slots)), PROMPTS[:slots], kd, [9] * slots)
    draft = [np.asarray(x) for x in eng.draft(st, eng.control(sampling))]
    return [r.tokens for r in res.results], draft


@pytest.mark.parametrize("kind", ["dspark", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tpu_draft_layout_decodes_as_the_cpu_one(target, monkeypatch, kind, temperature):
    """One slot (the head's rows padded 1 -> 8, the block 3 -> 8 slots) and the kernel's cache
    reads: the same drafts, distributions and confidences as the stacked, unpadded reference
    path, and so the same tokens."""
    drafter = tiny_drafter(kind, target, gamma=3)
    sampling = SamplingParams(temperature, 0, 1.0)
    tpu_tokens, tpu_draft = _run(target, drafter, sampling, monkeypatch, True)
    cpu_tokens, cpu_draft = _run(target, drafter, sampling, monkeypatch, False)
    assert tpu_tokens == cpu_tokens
    np.testing.assert_array_equal(tpu_draft[0], cpu_draft[0])
    for a, b in zip(tpu_draft[1:], cpu_draft[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_padding_slots_are_unseen(target, monkeypatch):
    """The padded block's extra slots must not be keys of the real ones: a block padded with
    slots every query sees (own-key count = the padded width) drafts with other confidences. (Its
    own context length: engines of the same shapes share compiled programs.)"""
    drafter = tiny_drafter("dspark", target, gamma=3)
    sampling = SamplingParams(0.0, 0, 1.0)
    _, cpu = _run(target, drafter, sampling, monkeypatch, False, max_len=44)
    real = backbone.OwnKeys
    monkeypatch.setattr(backbone, "OwnKeys", lambda k, v, n, causal: real(k, v, n * 0 + k.shape[1], causal))
    _, broken = _run(target, drafter, sampling, monkeypatch, True, max_len=44)
    assert np.abs(broken[2] - cpu[2]).max() > 1e-3


def test_round_verifies_in_the_cheapest_bucket_that_holds_it(target):
    """A table pricing the largest bucket cheapest: every round verifies there (RoundOut's bucket
    index), with the tokens of the same rounds in the smallest bucket that holds them."""
    import jax

    drafter = tiny_drafter("dspark", target, gamma=3)
    buckets = (2, 4, 8)
    eng = Engine(target, drafter, EngineConfig(policy="fixed",
                                               num_slots=2, max_len=40, prefill_buckets=(16,), buckets=buckets))
    kd = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 2)))
    greedy = SamplingParams(0.0, 0, 1.0)
    runs = {}
    for name, t_verify in (("top cheapest", [1.0, 1.2, 0.9]), ("rising", [1.0, 1.2, 1.5])):
        table = prefix.make_table(buckets, t_verify=t_verify, t_draft=0.1)
        st = eng.prefill_slots(eng.init_state(), [0, 1], PROMPTS[:2], kd, [9, 9])
        picked = []
        for _ in range(3):
            st, ro = eng.step(st, eng.control(greedy, gamma=1, table=table))  # 2 x (1 + 1) tokens a round
            picked.append(int(ro.bucket))
        runs[name] = (picked, np.asarray(st.out).tolist())
    assert set(runs["top cheapest"][0]) == {len(buckets) - 1}
    assert min(runs["rising"][0]) < len(buckets) - 1  # some round fits a smaller bucket
    assert runs["top cheapest"][1] == runs["rising"][1]


def test_holding_cost_is_the_cheapest_bucket_at_least_as_large():
    table = prefix.make_table((8, 16, 32, 64), t_verify=[1.0, 4.2, 4.3, 3.7], t_draft=0.1)
    np.testing.assert_allclose(np.asarray(prefix.holding_cost(table)), [1.0, 3.7, 3.7, 3.7])
    assert float(prefix.verify_time(20, table, cost="step")) == pytest.approx(3.7)
    assert float(prefix.verify_time(8, table, cost="step")) == pytest.approx(1.0)
