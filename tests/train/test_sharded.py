"""Sharded training on 8 fake CPU devices equals single-device training.

For data 2 x fsdp 2 x tensor 2 and for fsdp 8: the step's loss and parameters match the
one-device step, parameter and optimiser-state shardings follow the rules table, the
compiled step holds the expected collectives, and a checkpoint saved on one mesh
restores onto the other.
"""

import json

import numpy as np
import pytest

from tests.conftest import run_multidevice

SETUP = r"""
import json, sys, numpy as np, jax
jax.config.update("jax_default_matmul_precision", "highest")
from flax import nnx
from dspark_jax.config import from_cli
from dspark_jax.data.dataset import DatasetWriter
from dspark_jax.train.run import prepare_target
from dspark_jax.train.trainer import Phases, Trainer
from dspark_jax.data.dataset import TokenDataset

def make_data(path):
    rng = np.random.default_rng(0)
    w = DatasetWriter(path, vocab_size=512, overwrite=True)
    for _ in range(32):
        n = int(rng.integers(24, 48)); m = np.zeros(n, bool); m[6:] = True
        w.add(rng.integers(0, 500, n), m)
    w.close()
    return TokenDataset(path)

def trainer_for(root, mesh_args, tag):
    cfg = from_cli(["micro", f"train.output_dir={root}/{tag}", "data.seq_len=48", "data.num_anchors=8",
                    "train.batch_size=8", "train.steps=10", "train.anchor_chunk=4", *mesh_args])
    target = prepare_target(cfg, Phases())
    return Trainer(cfg, target.model, DS, None, progress=False)

def one_step(tr):
    tr.data_iter = tr._new_iter()
    batch = tr._device_batch(next(tr.data_iter))
    state, metrics, _ = tr.train_step(tr.state, tr.frozen, tr.t_state, batch)
    tr.state = state
    return float(metrics["loss"]), batch

def params_np(tr):
    return {k: np.asarray(v) for k, v in nnx.to_flat_state(tr.state.params)}
"""

SINGLE = SETUP + r"""
root = sys.argv[1] if len(sys.argv) > 1 else "/tmp"
"""

MULTI = SETUP + r"""
root = ROOT
DS = make_data(root + "/ds")
out = {}
trainers = {}
for tag, mesh_args in (("dft", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"]),
                       ("fsdp8", ["mesh.data=1", "mesh.fsdp=8"])):
    tr = trainer_for(root, mesh_args, tag)
    loss, batch = one_step(tr)
    p = tr.state.params
    q = p["layers"]["q_proj"][...]
    mu = tr.state.opt_state[1][0].mu["layers"]["q_proj"][...]
    w1 = p["markov_w1"][...]
    hlo = tr.train_step.lower(tr.state, tr.frozen, tr.t_state, batch).compile().as_text()
    np.savez(f"{root}/{tag}.npz", **{"/".join(map(str, k)): v for k, v in params_np(tr).items()})
    out[tag] = {"loss": loss, "q_spec": str(q.sharding.spec), "q_shard": list(q.addressable_shards[0].data.shape),
                "mu_spec": str(mu.sharding.spec), "w1_spec": str(w1.sharding.spec),
                "w1_shard": list(w1.addressable_shards[0].data.shape),
                "embed_spec": str(tr.frozen["embed"][...].sharding.spec),
                "collectives": sorted({c for c in ("all-reduce", "all-gather", "reduce-scatter",
                                                   "all-to-all", "collective-permute") if c in hlo})}
    trainers[tag] = tr
# checkpoint saved on the data x fsdp x tensor mesh, restored onto the fsdp-8 mesh
a, b = trainers["dft"], trainers["fsdp8"]
a.save(1, wait=True)
restored, _ = b.ckpt.__class__(a.ckpt.directory, 1, 2).restore(1, b._abstract_state())
ra = params_np(a)
rb = {k: np.asarray(v) for k, v in nnx.to_flat_state(restored.params)}
out["restore_equal"] = all(np.array_equal(ra[k], rb[k]) for k in ra)
out["restore_spec"] = str(restored.params["layers"]["q_proj"][...].sharding.spec)
print("RESULT" + json.dumps(out))
"""


def _single_device(tmp_path):
    from flax import nnx

    ns = {}
    exec(SETUP, ns)
    ns["DS"] = ns["make_data"](str(tmp_path / "ds"))
    tr = ns["trainer_for"](str(tmp_path), [], "single")
    loss, _ = ns["one_step"](tr)
    params = {"/".join(map(str, k)): np.asarray(v) for k, v in nnx.to_flat_state(tr.state.params)}
    tr.close()
    return loss, params


@pytest.mark.multidevice
def test_sharded_step_matches_single_device(tmp_path):
    loss1, params1 = _single_device(tmp_path / "single")
    root = tmp_path / "multi"
    root.mkdir()
    out = json.loads(run_multidevice(MULTI.replace("ROOT", repr(str(root)))).split("RESULT", 1)[1])
    for tag in ("dft", "fsdp8"):
        r = out[tag]
        assert abs(r["loss"] - loss1) < 1e-4, (tag, r["loss"], loss1)
        got = np.load(root / f"{tag}.npz")
        for k, v in params1.items():
            np.testing.assert_allclose(got[k], v, atol=2e-5, err_msg=f"{tag}: {k}")
    dft, f8 = out["dft"], out["fsdp8"]
    # rules table: layers -> None, embed -> fsdp, heads -> tensor; vocab -> tensor; rank -> None
    assert dft["q_spec"] == "P(None, 'fsdp', 'tensor')" and dft["q_shard"] == [1, 32, 32]
    assert dft["mu_spec"] == dft["q_spec"]  # Adam moments sharded like their parameters
    assert dft["w1_spec"] == "P('tensor', None)" and dft["w1_shard"] == [256, 16]
    assert dft["embed_spec"] == "P('tensor', 'fsdp')"
    assert f8["q_spec"] == "P(None, 'fsdp', None)" and f8["q_shard"] == [1, 8, 64]
    assert f8["mu_spec"] == f8["q_spec"]
    # gradients are reduced across the batch shards; fsdp weights are gathered
    assert "all-reduce" in dft["collectives"] and "all-gather" in f8["collectives"], out
    assert out["restore_equal"] and out["restore_spec"] == f8["q_spec"]
