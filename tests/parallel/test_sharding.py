"""Logical axis rules -> mesh shardings; building the target directly sharded on 8 fake devices."""

import json

import pytest
from jax.sharding import PartitionSpec as P

from dspark_jax.parallel.sharding import logical_to_pspec
from tests.conftest import run_multidevice


def test_rules_table():
    assert logical_to_pspec(("vocab", "embed")) == P("tensor", "fsdp")
    assert logical_to_pspec(("layers", "embed", "heads")) == P(None, "fsdp", "tensor")
    assert logical_to_pspec(("batch", "seq")) == P(("data", "fsdp"), None)
    assert logical_to_pspec(None) == P()


def test_indivisible_dimension_is_replicated_or_rejected():

    class FakeMesh:  # only .shape is read
        shape = {"data": 1, "fsdp": 2, "tensor": 4}

    assert logical_to_pspec(("embed", "heads"), (64, 6), FakeMesh()) == P("fsdp", None)
    with pytest.raises(ValueError,
                       match="dimension 1 \\('heads', size 6\\) is not divisible by mesh axes \\('tensor',\\)"):
        logical_to_pspec(("embed", "heads"), (64, 6), FakeMesh(), strict=True)


SHARDED_BUILD = r"""
import json, jax, jax.numpy as jnp, numpy as np
jax.config.update("jax_default_matmul_precision", "highest")
from flax import nnx
from dspark_jax.config import from_cli
from dspark_jax.target import TargetModel
from dspark_jax.parallel.sharding import create_model, make_mesh
cfg = from_cli(["micro"]).target.model
assert len(jax.devices()) == 8
single = create_model(lambda: TargetModel(cfg, rngs=nnx.Rngs(0)))
mesh = make_mesh(data=2, fsdp=2, tensor=2)
sharded = create_model(lambda: TargetModel(cfg, rngs=nnx.Rngs(0)), mesh)
toks = jnp.asarray(np.random.default_rng(0).integers(0, 512, (4, 16)))
a = jax.jit(lambda m, t: m(t).logits)(single, toks)
with jax.set_mesh(mesh):
    b = jax.jit(lambda m, t: m(t).logits)(sharded, toks)
q = sharded.layers.q_proj[...]
out = {
    "maxdiff": float(jnp.abs(a - b).max()),
    "q_spec": str(q.sharding.spec),
    "q_shard": list(q.addressable_shards[0].data.shape),
    "embed_spec": str(sharded.embed[...].sharding.spec),
    "embed_shard": list(sharded.embed[...].addressable_shards[0].data.shape),
}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.multidevice
def test_build_sharded_on_8_devices_matches_single_device():
    out = run_multidevice(SHARDED_BUILD)
    res = json.loads(out.split("RESULT", 1)[1])
    assert res["maxdiff"] < 1e-4
    assert res["q_spec"] == "P(None, 'fsdp', 'tensor')"
    assert res["q_shard"] == [2, 32, 32]  # [layers, 64/fsdp, 64/tensor]
    assert res["embed_spec"] == "P('tensor', 'fsdp')"
    assert res["embed_shard"] == [256, 32]


def test_device_grid_keeps_cpu_order_and_puts_data_across_slices():
    from types import SimpleNamespace

    import jax
    import pytest

    from dspark_jax.parallel.sharding import device_grid

    devs = jax.devices()
    grid = device_grid((len(devs), 1, 1), devs)
    assert list(grid.reshape(-1)) == list(devs)
    two_slices = [SimpleNamespace(slice_index=i // 2, id=i) for i in range(4)]
    with pytest.raises(ValueError, match="mesh.data=1 must be a multiple of the 2 slices"):
        device_grid((1, 4, 1), two_slices)
