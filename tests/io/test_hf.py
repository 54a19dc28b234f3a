"""Hugging Face import: parity with transformers, and one clear error per bad input."""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import load_target
from dspark_jax.io.hf import NotACheckpointError, save_target
from dspark_jax.io.keymap import CheckpointMismatchError
from dspark_jax.io.safetensors_io import CorruptCheckpointError
from dspark_jax.target.config import UnsupportedModelError
from tests.conftest import TORCH_MISSING


def _hf_forward(model, ids):
    torch = pytest.importorskip("torch", reason=TORCH_MISSING)
    with torch.no_grad():
        out = model(torch.as_tensor(ids), output_hidden_states=True)
    return out.logits.float().numpy(), [h.float().numpy() for h in out.hidden_states]


@pytest.mark.parametrize("name", ["qwen3_f32", "llama_f32"])
def test_float32_parity_with_transformers(hf_checkpoints, name):
    path, hf_model = hf_checkpoints[name]
    t = load_target(path)
    assert t.cfg.arch == ("qwen3" if name.startswith("qwen") else "llama")
    ids = np.random.default_rng(1).integers(0, 160, (2, 40))
    ref_logits, ref_hidden = _hf_forward(hf_model, ids)
    out = t.model(jnp.asarray(ids), feature_layers=(0, 1, 2))
    np.testing.assert_allclose(np.asarray(out.logits), ref_logits, atol=1e-4, rtol=0)
    for s, i in enumerate((0, 1, 2)):  # layer id i = HF hidden_states[i + 1]
        np.testing.assert_allclose(np.asarray(out.features[:, :, s]), ref_hidden[i + 1], atol=1e-4, rtol=0)


def test_bfloat16_checkpoint(hf_checkpoints):
    path, hf_model = hf_checkpoints["qwen3_bf16"]
    t = load_target(path, dtype="bfloat16")
    assert t.model.embed[...].dtype == jnp.bfloat16
    ids = np.random.default_rng(2).integers(0, 160, (1, 24))
    ref_logits, _ = _hf_forward(hf_model, ids)
    out = t.model(jnp.asarray(ids))
    # bf16 arithmetic differs in rounding order; the argmax and the bulk must agree
    got = np.asarray(out.logits)
    assert np.mean(np.abs(got - ref_logits)) < 0.05
    assert np.mean(got.argmax(-1) == ref_logits.argmax(-1)) > 0.9
    # the same weights loaded as float32 stay close to the bf16 reference
    t32 = load_target(path, dtype="float32")
    np.testing.assert_allclose(t32.model.embed[...], np.asarray(t.model.embed[...], np.float32))


def test_save_then_load_roundtrip(hf_checkpoints, tmp_path):
    path, _ = hf_checkpoints["qwen3_f32"]
    t = load_target(path)
    save_target(t.model, tmp_path / "out")
    t2 = load_target(tmp_path / "out")
    ids = jnp.arange(12)[None]
    np.testing.assert_array_equal(np.asarray(t.model(ids).logits), np.asarray(t2.model(ids).logits))


def test_sharded_checkpoint_with_index(hf_checkpoints, tmp_path):
    path, hf_model = hf_checkpoints["qwen3_f32"]
    hf_model.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    a = load_target(path).model(jnp.arange(8)[None]).logits
    b = load_target(tmp_path / "sharded").model(jnp.arange(8)[None]).logits
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ---- bad input -------------------------------------------------------------------

def test_not_a_checkpoint_dir(tmp_path):
    with pytest.raises(NotACheckpointError, match="has no config.json"):
        load_target(tmp_path)
    with pytest.raises(NotACheckpointError, match="is not a directory"):
        load_target(tmp_path / "nope")


def test_moe_architecture_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"],
                                                      "model_type": "qwen3_moe"}))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture 'Qwen3MoeForCausalLM'"):
        load_target(tmp_path)


def test_dtype_typo(hf_checkpoints):
    with pytest.raises(ValueError, match="unknown dtype 'bfloat61'; choose one of: float32, bfloat16"):
        load_target(hf_checkpoints["qwen3_f32"][0], dtype="bfloat61")


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_safetensors(hf_checkpoints, tmp_path):
    d = _copy(hf_checkpoints["qwen3_f32"][0], tmp_path / "c")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt safetensors"):
        load_target(d)
    f.write_bytes(b"\x05")
    with pytest.raises(CorruptCheckpointError, match="truncated or corrupt"):
        load_target(d)


def test_missing_unexpected_and_misshaped_keys_listed_together(hf_checkpoints, tmp_path):
    from dspark_jax.io import safetensors_io

    d = _copy(hf_checkpoints["qwen3_f32"][0], tmp_path / "c")
    tensors = dict(safetensors_io.load_file(d / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.extra.weight"] = np.zeros(3, np.float32)
    tensors["model.norm.weight"] = np.zeros(7, np.float32)
    tensors = {k: np.array(v) for k, v in tensors.items()}
    safetensors_io.save_file(tensors, d / "model.safetensors")
    with pytest.raises(CheckpointMismatchError) as e:
        load_target(d)
    msg = str(e.value)
    assert "missing keys (1): model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected keys (1): model.layers.0.extra.weight" in msg
    assert "model.norm.weight: shape (7,), expected (64,)" in msg


def test_tokenizer_required_message(hf_checkpoints):
    t = load_target(hf_checkpoints["qwen3_f32"][0])
    assert t.tokenizer is None
    with pytest.raises(FileNotFoundError, match="has no tokenizer.json, and this command needs a tokenizer"):
        t.require_tokenizer()


def test_pickle_weights_never_loaded(tmp_path, hf_checkpoints):
    d = tmp_path / "c"
    d.mkdir()
    shutil.copy(hf_checkpoints["qwen3_f32"][0] / "config.json", d)
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(NotACheckpointError, match="pickled weights are never loaded"):
        load_target(d)


# counts the elements read from per-layer tensors (pasted into the subprocess scripts below)
COUNT_READS = """
from dspark_jax.io import keymap
reads = []
orig = keymap.LayerStack.__getitem__
def counting(self, index):
    out = orig(self, index)
    reads.append(out.size)
    return out
keymap.LayerStack.__getitem__ = counting
"""

SHARDED_LOAD = r"""
import json, sys, numpy as np, jax
from dspark_jax import load_target
from dspark_jax.io import keymap
from dspark_jax.parallel.sharding import make_mesh

path = sys.argv[1]
COUNT_READS
whole = load_target(path, dtype="bfloat16")
reads.clear()
mesh = make_mesh(1, 4, 2)
sharded = load_target(path, dtype="bfloat16", mesh=mesh)
q = sharded.model.layers.q_proj[...]
res = {"q_spec": str(q.sharding.spec), "q_shard": list(q.addressable_shards[0].data.shape), "q_shape": list(q.shape),
       "layer_reads": sum(reads),
       "layer_elems": sum(int(np.prod(v.shape)) for v in jax.tree.leaves(sharded.model.layers.arrays())),
       "equal": all(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in
                    zip(jax.tree.leaves(jax.tree.map(lambda x: x, whole.model.layers.arrays())),
                        jax.tree.leaves(sharded.model.layers.arrays()))),
       "embed_equal": bool(np.array_equal(np.asarray(whole.model.embed[...], np.float32),
                                          np.asarray(sharded.model.embed[...], np.float32))),
       "dtype": str(q.dtype)}
print(json.dumps(res))
"""


def test_load_target_onto_a_mesh_reads_only_each_devices_block(hf_checkpoints):
    """Loaded onto a 4 x 2 (fsdp x tensor) mesh, every weight lands in its shards with the
    values of the whole load, and the per-layer tensors are read block by block: the elements
    read add up to what the 8 devices hold (each block once per device holding it), never the
    whole stack per device."""
    from tests.conftest import run_multidevice

    path, _ = hf_checkpoints["qwen3_bf16"]
    code = SHARDED_LOAD.replace("COUNT_READS", COUNT_READS).replace("sys.argv[1]", repr(str(path)))
    out = json.loads(run_multidevice(code).strip().splitlines()[-1])
    assert out["equal"] and out["embed_equal"] and out["dtype"] == "bfloat16"
    assert out["q_spec"] == "P(None, 'fsdp', 'tensor')"
    assert out["q_shard"] == [out["q_shape"][0], out["q_shape"][1] // 4, out["q_shape"][2] // 2]
    # every layer weight is sharded 8 ways or replicated on one axis: at most 2x the model's layer
    # elements are read in total (8 devices reading whole stacks would be 8x)
    assert out["layer_reads"] <= 2 * out["layer_elems"]


def test_auto_dtype_follows_the_stored_weights(hf_checkpoints, capsys):
    """`--dtype auto` (every inference command's default) loads a bf16 checkpoint in bf16 (half the
    memory) and a float32 one in float32."""
    import argparse

    from dspark_jax.cli import add_dtype_argument
    from dspark_jax.io.hf import checkpoint_dtype

    assert checkpoint_dtype(hf_checkpoints["qwen3_bf16"][0]) == "bfloat16"
    assert checkpoint_dtype(hf_checkpoints["qwen3_f32"][0]) == "float32"
    assert load_target(hf_checkpoints["qwen3_bf16"][0], dtype="auto").model.embed[...].dtype == jnp.bfloat16
    assert load_target(hf_checkpoints["qwen3_f32"][0], dtype="auto").model.embed[...].dtype == jnp.float32
    ap = argparse.ArgumentParser()
    add_dtype_argument(ap)
    assert ap.parse_args([]).dtype == "auto"
    for cmd in ("dspark_jax.commands.generate", "dspark_jax.commands.regenerate", "dspark_jax.commands.eval"):
        import importlib

        mod = importlib.import_module(cmd)
        with pytest.raises(SystemExit):
            (mod.parse_args if hasattr(mod, "parse_args") else mod.main)(["--help"])
        assert "--dtype {auto,float32,bfloat16}" in capsys.readouterr().out, cmd


MULTIPROCESS_LOAD = r"""
import json, numpy as np, jax
from dspark_jax.parallel.distributed import maybe_initialize_distributed
maybe_initialize_distributed()
from dspark_jax import load_target
from dspark_jax.io import keymap
from dspark_jax.parallel.sharding import make_mesh

path = PATH
whole = load_target(path, dtype="bfloat16", mesh=make_mesh(1, 1, 1, devices=jax.local_devices()[:1]))
ref = [np.asarray(x, np.float32) for x in jax.tree.leaves(whole.model.layers.arrays())]
COUNT_READS
sharded = load_target(path, dtype="bfloat16", mesh=make_mesh(1, 4, 2))
ok = True
for r, arr in zip(ref, jax.tree.leaves(sharded.model.layers.arrays())):
    for shard in arr.addressable_shards:  # this process's chips hold exactly their blocks of the file
        ok &= bool(np.array_equal(np.asarray(shard.data, np.float32), r[shard.index]))
print(json.dumps({"process": jax.process_index(), "processes": jax.process_count(), "ok": ok,
                  "local": len(jax.local_devices()), "global": jax.device_count(),
                  "reads": sum(reads), "elems": sum(r.size for r in ref)}))
"""


def test_target_loads_onto_a_mesh_spanning_two_processes(hf_checkpoints):
    """Two processes x 4 devices (`jax.distributed` on 127.0.0.1), one 4 x 2 mesh over all 8: each
    process reads only the blocks its own devices hold, and they equal the file's values."""
    from tests.conftest import REPO
    from tests.multiprocess import launch

    path, _ = hf_checkpoints["qwen3_bf16"]
    res = launch(["-c", MULTIPROCESS_LOAD.replace("COUNT_READS", COUNT_READS).replace("PATH", repr(str(path)))],
                 num_processes=2, devices_per_process=4,
                 timeout=300, cwd=REPO)
    outs = []
    for r in res:
        assert r.returncode == 0, r.output[-3000:]
        outs.append(json.loads([x for x in r.output.splitlines() if x.startswith("{")][-1]))
    assert sorted(o["process"] for o in outs) == [0, 1]
    for o in outs:
        assert o["ok"] and o["processes"] == 2 and o["local"] == 4 and o["global"] == 8
        # its 4 of the 8 devices hold about half of every layer tensor (measured: 0.503 of the
        # elements; reading the whole stack on each process would be >= 1)
        assert o["reads"] <= 0.6 * o["elems"], o
