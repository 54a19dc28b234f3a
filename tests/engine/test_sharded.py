"""The same round on a (data 4, tensor 2) mesh of 8 fake CPU devices equals the single-device result."""

from tests.conftest import run_multidevice

CODE = r"""
import jax, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from dspark_jax.engine import Engine, EngineConfig
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target
from dspark_jax.decoding.sampling import SamplingParams
from dspark_jax.parallel.sharding import make_mesh, shard_model
assert jax.device_count() == 8
cfg = tiny_config(vocab_size=16, hidden_size=32, num_layers=2)
t = tiny_target(cfg, logit_scale=1.0)
d = tiny_drafter("dspark", t, gamma=3)
prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 1], [3, 3, 3, 3]]
def run(tt, dd):
    eng = Engine(tt, dd, EngineConfig(policy="fixed", num_slots=4, max_len=32, buckets=(16,), prefill_buckets=(8,)))
    g = eng.generate(prompts, max_new_tokens=8, sampling=SamplingParams(0.0, 0, 1.0))
    s = eng.generate(prompts, max_new_tokens=8, sampling=SamplingParams(1.0, 0, 1.0), seed=1)
    return [r.tokens for r in g.results], [r.tokens for r in s.results]
ref = run(t, d)
mesh = make_mesh(data=4, tensor=2)
ts, ds = shard_model(t, mesh), shard_model(d, mesh)
assert len(ts.layers.q_proj[...].sharding.device_set) == 8
with jax.set_mesh(mesh):
    got = run(ts, ds)
assert got[0] == ref[0], (got[0], ref[0])
assert got[1] == ref[1], (got[1], ref[1])
print("OK")
"""


def test_sharded_round_equals_single_device():
    assert "OK" in run_multidevice(CODE)
