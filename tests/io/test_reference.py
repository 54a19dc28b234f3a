"""DeepSpec <-> dspark_jax drafter conversion: golden checks on hand-built reference-layout
tensors, export/import round trips, and bad-input errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.commands.convert import main
from dspark_jax.config import DrafterSection
from dspark_jax.drafter import attach_target, registry
from dspark_jax.drafter.backbone import fuse_context
from dspark_jax.drafter.confidence import confidence_logits
from dspark_jax.drafter.heads import head_bias_train
from dspark_jax.io import safetensors_io
from dspark_jax.io.drafter_dir import load as load_drafter
from dspark_jax.io.drafter_dir import save as save_drafter
from dspark_jax.io.hf import save_target
from dspark_jax.io.reference import ConversionError, read_reference, reference_tensors
from dspark_jax.parallel.sharding import create_model
from dspark_jax.target import TargetModel
from dspark_jax.target.config import ModelConfig
from dspark_jax.target.layers import rms_norm

TCFG = ModelConfig(arch="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                   num_kv_heads=2, head_dim=8, tie_word_embeddings=False, rope=ModelConfig().rope)
V, H, I, R = 96, 32, 64, 8
IDS = [0, 2]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("target")
    model = create_model(lambda: TargetModel(TCFG, rngs=nnx.Rngs(0)))
    save_target(model, path)
    return model, path


def make_reference(path, model, head="vanilla", rank=R, conf=True, with_markov=True, n_layers=2, seed=0, **cfg_over):
    """A DeepSpec-layout drafter directory written by hand (torch (out, in) layouts)."""
    rng = np.random.default_rng(seed)
    n = lambda *s: rng.normal(0, 0.3, s).astype(np.float32)
    m = len(IDS)
    t = {"embed_tokens.weight": np.asarray(model.embed[...]), "lm_head.weight": np.asarray(model.lm_head_weight()).T,
         "norm.weight": 1 + n(H), "fc.weight": n(H, m * H), "hidden_norm.weight": 1 + n(H)}
    for i in range(n_layers):
        L = f"layers.{i}."
        t |= {L + "input_layernorm.weight": 1 + n(H), L + "post_attention_layernorm.weight": 1 + n(H),
              L + "self_attn.q_proj.weight": n(32, H), L + "self_attn.k_proj.weight": n(16, H),
              L + "self_attn.v_proj.weight": n(16, H), L + "self_attn.o_proj.weight": n(H, 32),
              L + "self_attn.q_norm.weight": 1 + n(8), L + "self_attn.k_norm.weight": 1 + n(8),
              L + "mlp.gate_proj.weight": n(I, H), L + "mlp.up_proj.weight": n(I, H),
              L + "mlp.down_proj.weight": n(H, I)}
    if rank:
        t |= {"markov_head.markov_w1.weight": n(V, rank), "markov_head.markov_w2.weight": n(V, rank)}
        if head == "gated":
            t |= {"markov_head.gate_proj.weight": n(rank, H + rank), "markov_head.gate_proj.bias": n(rank)}
        if head == "rnn":
            t |= {"markov_head.joint_proj.weight": n(3 * rank, 2 * rank + H),
                  "markov_head.joint_proj.bias": n(3 * rank)}
    if conf:
        width = H + rank if with_markov and rank else H
        t |= {"confidence_head.proj.weight": n(1, width), "confidence_head.proj.bias": n(1)}
    cfg = {"architectures": ["Qwen3DSparkModel"], "model_type": "qwen3", "vocab_size": V, "hidden_size": H,
           "intermediate_size": I, "num_hidden_layers": n_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 8, "rms_norm_eps": TCFG.rms_norm_eps, "rope_theta": TCFG.rope.theta,
           "tie_word_embeddings": False,
           "layer_types": ["full_attention"] * n_layers, "block_size": 4, "mask_token_id": V - 1,
           "target_layer_ids": IDS, "num_target_layers": 4, "num_anchors": 512, "markov_rank": rank,
           "enable_confidence_head": conf}
    if rank:
        cfg["markov_head_type"] = head
    if conf:
        cfg["confidence_head_with_markov"] = with_markov
    cfg.update(cfg_over)
    path.mkdir(parents=True, exist_ok=True)
    safetensors_io.save_file(t, path / "model.safetensors")
    (path / "config.json").write_text(json.dumps(cfg))
    return t


@pytest.mark.parametrize("head", ["vanilla", "gated", "rnn"])
def test_golden_reference_layout(target, tmp_path, head):
    model, _ = target
    t = make_reference(tmp_path, model, head)
    d = read_reference(tmp_path, model)
    p = d.arrays()
    f64 = lambda k: t[k].astype(np.float64)
    rng = np.random.default_rng(1)
    # fc: feature block i multiplies fc.weight[:, i*H:(i+1)*H] (layer-id order)
    feats = rng.normal(0, 1, (3, 2, H))
    want = sum(feats[:, i] @ f64("fc.weight")[:, i * H:(i + 1) * H].T for i in range(2))
    got = fuse_context(p, jnp.asarray(feats, jnp.float32), d.cfg)
    np.testing.assert_allclose(np.asarray(got),
                               np.asarray(rms_norm(jnp.asarray(want, jnp.float32), p["hidden_norm"],
                                                   d.cfg.rms_norm_eps)),
                               atol=1e-4)
    # heads, in torch layout: W1 (V, r) embedding, W2 (V, r) Linear, gate (r, H+r), joint (3r, 2r+H) gate|cand|out
    G = 3
    h = rng.normal(0, 1, (2, G, H))
    prev = rng.integers(0, V, (2, G))
    w1, w2 = f64("markov_head.markov_w1.weight"), f64("markov_head.markov_w2.weight")
    got = np.asarray(head_bias_train(p, jnp.asarray(h, jnp.float32), jnp.asarray(prev)))
    s = np.zeros((2, R))
    for j in range(G):
        e = w1[prev[:, j]]
        if head == "vanilla":
            want = e @ w2.T  # = W2 @ W1[x]
        elif head == "gated":
            g = 1 / (1 + np.exp(-(np.concatenate([h[:, j], e], -1) @ f64("markov_head.gate_proj.weight").T
                                  + f64("markov_head.gate_proj.bias"))))
            want = (g * e) @ w2.T
        else:
            z = (np.concatenate([s, e, h[:, j]], -1) @ f64("markov_head.joint_proj.weight").T
                 + f64("markov_head.joint_proj.bias"))
            gate, cand, out = 1 / (1 + np.exp(-z[:, :R])), np.tanh(z[:, R:2 * R]), np.tanh(z[:, 2 * R:])
            s = gate * s + (1 - gate) * cand
            want = out @ w2.T
        np.testing.assert_allclose(got[:, j], want, atol=1e-4)
    zc = np.concatenate([h, w1[prev]], -1) @ f64("confidence_head.proj.weight").T + f64("confidence_head.proj.bias")
    np.testing.assert_allclose(np.asarray(confidence_logits(p, jnp.asarray(h, jnp.float32), jnp.asarray(prev))),
                               zc[..., 0], atol=1e-4)
    # import -> export gives back the same tensors, bit for bit
    back = reference_tensors(d, "float32")
    assert sorted(back) == sorted(t)
    for k in t:
        np.testing.assert_array_equal(back[k], t[k], err_msg=k)


def test_confidence_head_without_markov_input_is_padded(target, tmp_path):
    model, _ = target
    t = make_reference(tmp_path, model, with_markov=False)
    d = read_reference(tmp_path, model)
    h = np.random.default_rng(0).normal(0, 1, (4, H))
    want = h @ t["confidence_head.proj.weight"].T.astype(np.float64) + t["confidence_head.proj.bias"]
    got = confidence_logits(d.arrays(), jnp.asarray(h, jnp.float32), jnp.arange(4))
    np.testing.assert_allclose(np.asarray(got), want[:, 0], atol=1e-5)


@pytest.mark.parametrize("kw", [dict(head_type="vanilla"), dict(head_type="gated"), dict(head_type="rnn"),
                                dict(kind="dflash"), dict(head_type="rnn", markov_rank=0)])
def test_export_import_bit_identical(target, tmp_path, kw):
    model, tdir = target
    dcfg = DrafterSection(num_layers=2, gamma=5, target_layer_ids=(0, 2), num_target_features=2, markov_rank=R,
                          mask_token_id=7, **{k: v for k, v in kw.items() if k != "markov_rank"})
    if "markov_rank" in kw:
        dcfg = DrafterSection(**{**dcfg.__dict__, "markov_rank": kw["markov_rank"]})
    d = create_model(lambda: registry.build(TCFG, dcfg, rngs=nnx.Rngs(5)))
    attach_target(d, model)
    save_drafter(d, tmp_path / "ours")
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "ref"), "--target", str(tdir), "--dtype", "float32",
                 "--num-anchors", "512"]) == 0
    hf = json.loads((tmp_path / "ref" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3DSparkModel"] and hf["num_hidden_layers"] == 2
    assert hf["layer_types"] == ["full_attention"] * 2 and hf["block_size"] == 5 and hf["mask_token_id"] == 7
    assert hf["target_layer_ids"] == [0, 2] and hf["num_target_layers"] == 4 and hf["num_anchors"] == 512
    assert hf["markov_rank"] == d.dcfg.markov_rank and hf["enable_confidence_head"] == d.dcfg.confidence_head
    assert hf.get("markov_head_type") == (d.dcfg.head_type if d.dcfg.markov_rank else None)
    assert hf["hidden_size"] == H and hf["vocab_size"] == V and hf["intermediate_size"] == I
    ref = safetensors_io.load_file(tmp_path / "ref" / "model.safetensors")
    assert "embed_tokens.weight" in ref and "lm_head.weight" in ref
    assert main(["import", str(tmp_path / "ref"), str(tmp_path / "back"), "--target", str(tdir)]) == 0
    back = load_drafter(tmp_path / "back", model)
    assert back.dcfg == d.dcfg
    a, b = nnx.to_pure_dict(nnx.state(d)), nnx.to_pure_dict(nnx.state(back))
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def _reference_error(target, tmp_path, match, tensors=None, **kw):
    model, _ = target
    t = make_reference(tmp_path, model, **kw)
    if tensors:
        t = tensors(t)
        safetensors_io.save_file(t, tmp_path / "model.safetensors")
    with pytest.raises(ConversionError, match=match) as e:
        read_reference(tmp_path, model)
    return str(e.value)


@pytest.mark.parametrize("kw,match", [
    (dict(vocab_size=100), "vocab_size is 100 in the drafter but 96 in the target"),
    (dict(hidden_size=48), "hidden_size is 48 in the drafter but 32"),
    (dict(target_layer_ids=[0, 3]), r"exceed 2"),
    (dict(target_layer_ids=[-1, 2]), "embedding output"),
    (dict(num_target_layers=36), "num_target_layers is 36"),
    (dict(markov_head_type="lstm"), "unknown markov_head_type 'lstm'"),
    (dict(mask_token_id=96), "mask_token_id 96 is outside"),
    (dict(block_size=0), "block_size must be >= 1"),
    (dict(architectures=["Qwen3ForCausalLM"]), "not a DeepSpec"),
])
def test_bad_reference_config(target, tmp_path, kw, match):
    _reference_error(target, tmp_path, match, **kw)


def test_bad_config_reports_all_problems(target, tmp_path):
    msg = _reference_error(target, tmp_path, "vocab_size", vocab_size=100, mask_token_id=500, markov_head_type="x")
    assert "mask_token_id 500" in msg and "markov_head_type 'x'" in msg


def test_missing_unexpected_misshaped_keys_all_at_once(target, tmp_path):
    def edit(t):
        t = dict(t)
        del t["fc.weight"], t["layers.1.mlp.up_proj.weight"]
        t["markov_head.extra.weight"] = np.zeros(2, np.float32)
        t["markov_head.markov_w2.weight"] = np.zeros((V, R + 1), np.float32)
        return t

    msg = _reference_error(target, tmp_path, "does not match", tensors=edit)
    for part in ("fc.weight", "layers.1.mlp.up_proj.weight", "markov_head.extra.weight",
                 "markov_head.markov_w2.weight"):
        assert part in msg


def test_embedding_of_another_target_is_refused(target, tmp_path):
    def edit(t):
        return {**t, "embed_tokens.weight": t["embed_tokens.weight"] + 0.5}

    _reference_error(target, tmp_path, "embed_tokens.weight differs from the target", tensors=edit)


def test_cli_help_and_errors(target, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "import" in capsys.readouterr().out
    model, tdir = target
    make_reference(tmp_path / "ref", model, vocab_size=100)
    assert main(["import", str(tmp_path / "ref"), str(tmp_path / "out"), "--target", str(tdir)]) == 2
    assert "vocab_size is 100" in capsys.readouterr().err


def test_export_of_a_kind_without_reference_layout_is_refused(target, tmp_path, capsys):
    from dspark_jax.drafter import registry

    model, tdir = target
    d = create_model(lambda: registry.build(TCFG, DrafterSection(kind="mtp1"), rngs=nnx.Rngs(0)))
    attach_target(d, model)
    save_drafter(d, tmp_path / "ours")
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "ref"), "--target", str(tdir)]) != 0
    err = capsys.readouterr().err
    assert "mtp1 drafter, which has no DeepSpec reference layout" in err and "dspark, dflash" in err
    assert not (tmp_path / "ref").exists()


# ---------------------------------------------------------------------------- export for serving engines


def _dspark(model, **kw):
    dcfg = DrafterSection(num_layers=2, gamma=5, target_layer_ids=(0, 2), num_target_features=2, markov_rank=R,
                          mask_token_id=7, **kw)
    d = create_model(lambda: registry.build(TCFG, dcfg, rngs=nnx.Rngs(5)))
    attach_target(d, model)
    return d


def test_export_config_read_by_transformers_has_every_engine_field(target, tmp_path, dspark_caplog):
    """What vLLM / SGLang read (ENGINE_FIELDS), read back through transformers' config machinery
    as the engines do; bfloat16 tensors by default; the run's num_anchors."""
    transformers = pytest.importorskip("transformers")
    from dspark_jax.io import drafter_dir
    from dspark_jax.io.reference import ENGINE_FIELDS, SAMPLE_FROM_ANCHOR

    model, tdir = target
    d = _dspark(model)
    drafter_dir.save(d, tmp_path / "ours", training={"num_anchors": 24})
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "ref"), "--target", str(tdir)]) == 0
    assert "num_anchors 24 (read from" in dspark_caplog.text
    raw = json.loads((tmp_path / "ref" / "config.json").read_text())
    auto = transformers.AutoConfig.from_pretrained(tmp_path / "ref")
    plain = transformers.PretrainedConfig.from_json_file(str(tmp_path / "ref" / "config.json"))
    want = {
        "architectures": ["Qwen3DSparkModel"], "sample_from_anchor": True, "block_size": 5,
        "target_layer_ids": [0, 2], "num_target_layers": 4, "mask_token_id": 7, "markov_rank": R,
        "markov_head_type": "vanilla", "enable_confidence_head": True, "confidence_head_with_markov": True,
        "draft_vocab_size": V, "vocab_size": V, "hidden_size": H, "num_hidden_layers": 2, "head_dim": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": I, "hidden_act": "silu",
        "rms_norm_eps": TCFG.rms_norm_eps, "max_position_embeddings": TCFG.max_position_embeddings,
        "attention_bias": False, "layer_types": ["full_attention"] * 2, "sliding_window": None, "is_causal": False,
        "is_neox_style": True, "tie_word_embeddings": False, "num_anchors": 24,
    }
    assert SAMPLE_FROM_ANCHOR is True
    # the table and this test cover the same fields (a field added to one must be checked here)
    assert {f.name for f in ENGINE_FIELDS} == set(want) | {"rope_parameters", "dtype"}
    for cfg in (auto, plain):
        for name, value in want.items():
            assert getattr(cfg, name) == value, (type(cfg).__name__, name, getattr(cfg, name, None), value)
        assert cfg.rope_parameters["rope_theta"] == TCFG.rope.theta
        assert str(cfg.dtype).removeprefix("torch.") == "bfloat16"
    assert type(auto).__name__ == "Qwen3Config" and auto.model_type == "qwen3"
    assert raw["dtype"] == raw["torch_dtype"] == "bfloat16"
    # the speculators format's keys would send loaders down that format's code path
    assert not {"speculators_config", "speculators_model_type", "dflash_config", "eagle_aux_hidden_state_layer_ids",
                "dspark_target_layer_ids"} & set(raw)
    header, _ = safetensors_io.read_header(tmp_path / "ref" / "model.safetensors")
    dtypes = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes and set(dtypes.values()) == {"BF16"}
    # bfloat16 round trip: the import reads it back (weights rounded once), and keeps num_anchors
    assert main(["import", str(tmp_path / "ref"), str(tmp_path / "back"), "--target", str(tdir)]) == 0
    assert drafter_dir.read_training(tmp_path / "back") == {"num_anchors": 24}
    back = load_drafter(tmp_path / "back", model)
    a, b = nnx.to_pure_dict(nnx.state(d, nnx.Param)), nnx.to_pure_dict(nnx.state(back, nnx.Param))
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=2.0**-8, atol=1e-30), a, b)


def test_num_anchors_recorded_or_given(target, tmp_path, capsys, dspark_caplog):
    """Export writes the run's num_anchors (training.num_anchors in drafter_config.json) or
    --num-anchors; a drafter that records none is refused in one line naming the flag."""
    from dspark_jax.io import drafter_dir

    model, tdir = target
    d = _dspark(model, head_type="gated")
    drafter_dir.save(d, tmp_path / "drafter")  # no training record: not written by a training run

    def export(*extra):
        out = tmp_path / f"ref{len(list(tmp_path.iterdir()))}"
        rc = main(["export", str(tmp_path / "drafter"), str(out), "--target", str(tdir), *extra])
        cfg = out / "config.json"
        return rc, json.loads(cfg.read_text())["num_anchors"] if cfg.is_file() else None, capsys.readouterr().err

    rc, n, err = export()
    assert rc == 2 and n is None and err.count("\n") == 1
    assert "records no training num_anchors" in err and "--num-anchors N" in err
    rc, n, err = export("--num-anchors", "64")
    assert (rc, n) == (0, 64)
    assert "markov_head_type 'gated'" in dspark_caplog.text  # the engines build only the vanilla head
    drafter_dir.save(d, tmp_path / "drafter", training={"num_anchors": 32})
    rc, n, err = export()
    assert (rc, n) == (0, 32) and "num_anchors 32 (read from" in dspark_caplog.text
    assert export("--num-anchors", "48")[:2] == (0, 48)


@pytest.mark.parametrize("kind,reason", [("eagle3", "no vLLM / SGLang EAGLE-3 config contract"),
                                         ("mtp1", "inside the target's own checkpoint")])
def test_export_refusal_says_why_and_what_to_use(target, tmp_path, capsys, kind, reason):
    from dspark_jax.drafter import registry

    model, tdir = target
    d = create_model(lambda: registry.build(TCFG, DrafterSection(kind=kind, target_layer_ids=(0, 2)), rngs=nnx.Rngs(0)))
    attach_target(d, model)
    save_drafter(d, tmp_path / "ours")
    assert main(["export", str(tmp_path / "ours"), str(tmp_path / "ref"), "--target", str(tdir)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and reason in err and "python -m dspark_jax serve" in err
    assert not (tmp_path / "ref").exists()
