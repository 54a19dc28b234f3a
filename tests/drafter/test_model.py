"""Drafter module: parameter names / shapes / logical axes, Frozen weights kept out of
gradients, optimiser state and checkpoints, config resolution errors, save / load."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from dspark_jax.config import DrafterSection
from dspark_jax.drafter import (
    DrafterConfigError,
    Frozen,
    TargetMismatchError,
    attach_target,
    backbone,
    default_layer_ids,
    drafter_checkpoint_state,
    heads,
    registry,
    resolve_layer_ids,
    trainable_state,
)
from dspark_jax.io.drafter_dir import load as load_drafter
from dspark_jax.io.drafter_dir import save as save_drafter
from dspark_jax.io.keymap import CheckpointMismatchError, flatten
from dspark_jax.parallel.sharding import create_model
from dspark_jax.target import TargetModel
from dspark_jax.target.config import ModelConfig

V, H, r = 512, 64, 16


def make(micro_cfg, rngs=0, **kw):
    dcfg = dataclasses.replace(micro_cfg.drafter, **kw)
    return create_model(lambda: registry.build(micro_cfg.target.model, dcfg, rngs=nnx.Rngs(rngs)))


@pytest.fixture(scope="module")
def drafters(micro_cfg, micro_target):
    out = {}
    for i, (name, kw) in enumerate([("vanilla", {}), ("gated", dict(head_type="gated")), ("rnn", dict(head_type="rnn")),
                                    ("dflash", dict(kind="dflash"))]):
        d = make(micro_cfg, i, **kw)
        attach_target(d, micro_target)
        out[name] = d
    return out


EXPECTED = {
    "vanilla": {"markov_w1": (V, r), "markov_w2": (r, V), "conf_kernel": (H + r, 1), "conf_bias": (1,)},
    "gated": {"markov_w1": (V, r), "markov_w2": (r, V), "gate_kernel": (H + r, r), "gate_bias": (r,),
              "conf_kernel": (H + r, 1), "conf_bias": (1,)},
    "rnn": {"markov_w1": (V, r), "markov_w2": (r, V), "joint_kernel": (2 * r + H, 3 * r), "joint_bias": (3 * r,),
            "conf_kernel": (H + r, 1), "conf_bias": (1,)},
    "dflash": {},
}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_param_names_shapes_and_axes(drafters, name):
    d = drafters[name]
    state = nnx.state(d, nnx.Param)
    shapes = {k: tuple(v.shape) for k, v in flatten(nnx.to_pure_dict(state)).items()}
    base = {"fc": (H, H), "hidden_norm": (H,), "final_norm": (H,)}
    top = {k: v for k, v in shapes.items() if not k.startswith("layers.")}
    assert top == {**base, **EXPECTED[name]}
    assert shapes["layers.q_proj"] == (1, H, H) and "layers.k_norm" in shapes  # Qwen3 layer math
    # no trainable leaf is vocabulary-sized except the Markov factors
    for k, s in shapes.items():
        if V in s:
            assert k in ("markov_w1", "markov_w2"), k
    # every Param carries logical axis names, one per dimension
    for path, v in jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        names = v.get_metadata().get("out_sharding")
        assert names is not None and len(names) == v.ndim, (path, names)
    assert d.fc.get_metadata()["out_sharding"] == ("fused", "embed")
    if name != "dflash":
        assert d.markov_w1.get_metadata()["out_sharding"] == ("vocab", "rank")
        assert d.markov_w2.get_metadata()["out_sharding"] == ("rank", "vocab")


def test_frozen_weights_are_the_targets_and_out_of_training(drafters, micro_target):
    d = drafters["gated"]
    assert isinstance(d.embed, Frozen) and not isinstance(d.embed, nnx.Param)
    np.testing.assert_array_equal(np.asarray(d.embed[...]), np.asarray(micro_target.embed[...]))
    np.testing.assert_array_equal(np.asarray(d.lm_head[...]), np.asarray(micro_target.lm_head_weight()))
    params = flatten(nnx.to_pure_dict(trainable_state(d)))
    assert "embed" not in params and "lm_head" not in params
    opt = nnx.Optimizer(d, optax.adamw(1e-3), wrt=nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(opt))[0]
    assert not any(("embed" in jax.tree_util.keystr(p) or "lm_head" in jax.tree_util.keystr(p)) for p, _ in leaves)
    assert not any(getattr(x, "shape", ()) in ((V, H), (H, V)) for _, x in leaves)

    def loss(model):
        p = model.arrays()
        ctx = backbone.fuse_context(p, jnp.ones((1, 8, 1, H)), model.cfg)
        h = backbone.backbone_train(p, model.cfg, jnp.zeros((1, 8), jnp.int32), ctx, jnp.array([[3]]),
                                    jnp.array([[True]]), gamma=model.gamma, mask_id=model.mask_token_id)
        return heads.base_logits(p, h).sum() + heads.head_bias_train(p, h, jnp.zeros((1, 1, 4), jnp.int32)).sum()

    grads = nnx.jit(nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Param)))(d)
    assert "embed" not in grads and "lm_head" not in grads
    assert np.abs(np.asarray(grads["fc"][...])).max() > 0
    ckpt = drafter_checkpoint_state(d)
    assert "embed" not in ckpt["params"] and ckpt["target_fingerprint"] == d.target_fingerprint


def test_default_layer_ids():
    assert default_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_layer_ids(40, 5) == (1, 10, 19, 28, 37)
    assert default_layer_ids(8, 5) == (1, 2, 3, 4, 5)
    tcfg = ModelConfig(num_layers=36)
    assert resolve_layer_ids(tcfg, DrafterSection(mask_token_id=1)) == (1, 9, 17, 25, 33)
    with pytest.raises(DrafterConfigError, match="default target_layer_ids.*set drafter.target_layer_ids"):
        resolve_layer_ids(ModelConfig(num_layers=7), DrafterSection(mask_token_id=1))


@pytest.mark.parametrize("kw,match", [
    (dict(target_layer_ids=(0, 1)), r"exceed 0.*2 layers"),  # the final layer is never a feature layer
    (dict(target_layer_ids=(-1, 0)), "negative"),
    (dict(mask_token_id=512), "mask_token_id 512 is outside"),
    (dict(mask_token_id=None), "mask_token_id is not set"),
    (dict(head_type="lstm"), "unknown drafter.head_type 'lstm'"),
])
def test_config_errors(micro_cfg, kw, match):
    with pytest.raises(DrafterConfigError, match=match):
        make(micro_cfg, **kw)


def test_section_errors(micro_cfg):
    with pytest.raises(ValueError, match="gamma must be >= 1"):
        dataclasses.replace(micro_cfg.drafter, gamma=0)
    with pytest.raises(ValueError, match="strictly increasing"):
        dataclasses.replace(micro_cfg.drafter, target_layer_ids=(2, 1))


def test_dflash_forces_no_heads(drafters):
    d = drafters["dflash"]
    assert d.dcfg.markov_rank == 0 and not d.dcfg.confidence_head and d.head_type is None
    assert d.markov_w1 is None and d.conf_kernel is None


def test_save_load_roundtrip(drafters, micro_cfg, micro_target, tmp_path):
    for name, d in drafters.items():
        save_drafter(d, tmp_path / name)
        cfg = json.loads((tmp_path / name / "drafter_config.json").read_text())
        assert cfg["target_fingerprint"] == d.target_fingerprint and cfg["target_layer_ids"] == [0]
        back = load_drafter(tmp_path / name, micro_target)
        a, b = nnx.to_pure_dict(nnx.state(d)), nnx.to_pure_dict(nnx.state(back))
        jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
        assert back.dcfg == d.dcfg
    # another target: refused, naming the reason
    other = create_model(lambda: TargetModel(micro_cfg.target.model, rngs=nnx.Rngs(99)))
    with pytest.raises(TargetMismatchError, match="different target"):
        load_drafter(tmp_path / "vanilla", other)


def test_load_reports_all_key_problems(drafters, micro_target, tmp_path):
    from dspark_jax.io import safetensors_io

    save_drafter(drafters["rnn"], tmp_path)
    t = safetensors_io.load_file(tmp_path / "drafter.safetensors")
    t = {k: np.array(v) for k, v in t.items() if k not in ("fc", "joint_bias")}
    t["bogus"] = np.zeros(3, np.float32)
    t["markov_w2"] = np.zeros((3, 3), np.float32)
    safetensors_io.save_file(t, tmp_path / "drafter.safetensors")
    with pytest.raises(CheckpointMismatchError) as e:
        load_drafter(tmp_path, micro_target)
    msg = str(e.value)
    assert "fc" in msg and "joint_bias" in msg and "bogus" in msg and "markov_w2: shape (3, 3)" in msg


def test_bfloat16_parameters_roundtrip(micro_cfg, micro_target, tmp_path):
    dcfg = dataclasses.replace(micro_cfg.drafter, head_type="rnn")
    d = create_model(lambda: registry.build(micro_cfg.target.model, dcfg, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16))
    attach_target(d, micro_target)
    assert d.fc[...].dtype == jnp.bfloat16
    assert d.embed[...] is micro_target.embed[...]  # the target's own array is shared, not copied
    assert d.arrays()["embed"].dtype == jnp.bfloat16
    save_drafter(d, tmp_path)
    back = load_drafter(tmp_path, micro_target, param_dtype=jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(back.joint_kernel[...], np.float32),
                                  np.asarray(d.joint_kernel[...], np.float32))
    assert back.arrays()["embed"].dtype == jnp.bfloat16
    assert back.arrays(jnp.float32)["fc"].dtype == jnp.float32
