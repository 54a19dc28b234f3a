"""The block drafter's decode layout (drafter/decode_weights.py): layers one dict each, q/k/v and
gate/up merged as the target's, k / v kept for the context; and, laid out for a slice, the feature
projection split over tensor on its output and the Markov W1 whole on every chip."""

import dataclasses

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dspark_jax.drafter.decode_weights import drafter_decode_arrays
from dspark_jax.target.merged import split_qkv
from dspark_jax.testing.tiny import tiny_drafter


def test_layers_split_merged_and_kv_kept(target):
    drafter = tiny_drafter("dspark", target, gamma=3)
    arrays = drafter.arrays()
    out = drafter_decode_arrays(arrays, drafter.cfg, per_layer=True)
    stacked = arrays["layers"]
    assert isinstance(out["layers"], tuple) and len(out["layers"]) == drafter.dcfg.num_layers
    for i, p in enumerate(out["layers"]):
        assert "qkv_proj" in p and "gate_up_proj" in p and "q_proj" not in p
        np.testing.assert_array_equal(p["k_proj"], stacked["k_proj"][i])
        np.testing.assert_array_equal(p["v_proj"], stacked["v_proj"][i])
        x = np.ones((1, 1, drafter.cfg.hidden_size), np.float32)
        q, k, _ = split_qkv(x @ np.asarray(p["qkv_proj"]).T, drafter.cfg)
        np.testing.assert_allclose(np.asarray(k).reshape(-1), (x @ np.asarray(stacked["k_proj"][i])).reshape(-1),
                                   rtol=1e-5, atol=1e-5)
    assert drafter_decode_arrays(arrays, drafter.cfg, per_layer=False)["layers"] is stacked


@pytest.fixture(scope="module")
def target():
    from dspark_jax.testing.tiny import tiny_config, tiny_target

    return tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)


def test_laid_out_for_a_slice():
    pytest.importorskip("libtpu", reason="the TPU compiler ships in libtpu: pip install -e '.[aot]'")
    from dspark_jax.config import from_cli
    from dspark_jax.engine.config import EngineConfig
    from dspark_jax.engine.plan import abstract_engine, plan_mesh

    cfg = from_cli(["configs/qwen3_8b_dspark.yaml", "target.model.num_layers=4", "drafter.target_layer_ids=[0,1,2]",
                    "drafter.num_layers=2"])
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, dtype="bfloat16"))
    ab = abstract_engine(cfg, plan_mesh((1, 1, 8), "v6e-8"), EngineConfig(policy="fixed", num_slots=8, max_len=256),
                         drafter_in_target_dtype=True)
    dt = ab.dt
    assert dt["fc"].sharding.spec == P(None, "tensor")
    assert all(x is None for x in dt["markov_w1"].sharding.spec)  # whole on every chip
    assert dt["markov_w2"].sharding.spec == P(None, "tensor")
    assert isinstance(dt["layers"], tuple) and len(dt["layers"]) == 2
    assert dt["layers"][0]["qkv_proj"].sharding.spec[0] == "tensor"
    per_chip = lambda a: int(np.prod(a.sharding.shard_shape(a.shape)))
    assert per_chip(dt["fc"]) * 8 == int(np.prod(dt["fc"].shape))
    assert jax.tree.leaves(dt)  # the programs take this tree as it is
