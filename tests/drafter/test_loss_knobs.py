"""The loss switches the ablations use: `train.loss_conf_detach` (the confidence loss stops at the
backbone) and `train.loss_weights` (DFlash trained with the configured weighting)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.config import ConfigError, from_cli
from dspark_jax.drafter import registry
from dspark_jax.drafter.losses import LossCoefs, slot_weights
from dspark_jax.testing.tiny import tiny_config, tiny_drafter, tiny_target

G = 3


@pytest.fixture(scope="module")
def setup():
    target = tiny_target(tiny_config(vocab_size=16, hidden_size=32, num_layers=2), logit_scale=1.0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 15, (2, 12)), jnp.int32)
    anchors = jnp.asarray([[0, 3, 6, 8], [1, 2, 5, 7]], jnp.int32)
    batch = {"tokens": tokens, "anchors": anchors, "keep": jnp.ones((2, 4), bool),
             "block_valid": jnp.ones((2, 4, G), bool)}
    return target, batch


def _loss_and_grads(target, batch, kind, coefs):
    drafter = tiny_drafter(kind, target, gamma=G)
    k = registry.get_kind(kind)
    out = target(batch["tokens"], feature_layers=tuple(drafter.dcfg.target_layer_ids))
    out = jax.tree.map(jax.lax.stop_gradient, out)
    params = drafter.arrays()

    def f(p):
        return k.loss(p, drafter, out, batch, coefs=coefs, chunk=4, ttt_steps=1)

    (loss, (metrics, _)), grads = jax.value_and_grad(f, has_aux=True)(params)
    return loss, metrics, grads


def _norm(tree) -> float:
    return float(sum(jnp.sum(jnp.abs(x)) for x in jax.tree.leaves(tree)))


@pytest.mark.parametrize("detach", [False, True])
def test_confidence_loss_reaches_the_backbone_unless_detached(setup, detach):
    """BCE alone: its gradient w.r.t. the backbone (fc, the drafter layers, the norms) is exactly
    zero with conf_detach and not without; the confidence head itself is trained either way."""
    target, batch = setup
    coefs = LossCoefs(ce=0.0, l1=0.0, conf=1.0, conf_detach=detach)
    loss, metrics, g = _loss_and_grads(target, batch, "dspark", coefs)
    assert float(metrics["conf_bce"]) > 0
    backbone = _norm({k: g[k] for k in ("fc", "layers", "hidden_norm", "final_norm")})
    assert (backbone == 0.0) == detach, backbone
    assert _norm(g["conf_kernel"]) > 0
    assert _norm(g["markov_w2"]) == 0.0  # the Markov head's output weights never see the BCE


def test_detaching_leaves_the_loss_value_and_the_draft_gradients_unchanged(setup):
    target, batch = setup
    full = LossCoefs()
    l0, _, g0 = _loss_and_grads(target, batch, "dspark", full)
    l1, _, g1 = _loss_and_grads(target, batch, "dspark", full._replace(conf_detach=True))
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(g0["markov_w2"]), np.asarray(g1["markov_w2"]), rtol=1e-5, atol=1e-9)
    assert not np.allclose(np.asarray(g0["fc"]), np.asarray(g1["fc"]))  # the BCE's share is gone


def test_dflash_with_configured_weights_trains_on_ce_and_l1(setup):
    """kind_weights (default): DFlash's loss is its CE; kind_weights False: 0.1 CE + 0.9 L1 (no
    confidence head, so no BCE term)."""
    target, batch = setup
    own, m_own, _ = _loss_and_grads(target, batch, "dflash", LossCoefs())
    cfgd, m_cfg, _ = _loss_and_grads(target, batch, "dflash", LossCoefs(kind_weights=False))
    np.testing.assert_allclose(float(own), float(m_own["ce"]), rtol=1e-6)
    np.testing.assert_allclose(float(cfgd), 0.1 * float(m_cfg["ce"]) + 0.9 * float(m_cfg["l1"]), rtol=1e-6)
    assert abs(float(cfgd) - float(own)) > 1e-3


def test_train_section_maps_to_coefficients():
    cfg = from_cli(["train.loss_conf_detach=true", "train.loss_weights=config", "train.loss_ce=1.0"])
    c = LossCoefs.from_train(cfg.train, 7)
    assert c.conf_detach and not c.kind_weights and c.ce == 1.0
    d = LossCoefs.from_train(from_cli([]).train, 7)
    assert not d.conf_detach and d.kind_weights


def test_unknown_loss_weights_is_one_clear_error():
    with pytest.raises(ConfigError, match="loss_weights"):
        from_cli(["train.loss_weights=paper"])


def test_paper_weighting_decays_with_gamma():
    """`loss_decay: gamma` weighs slot j by exp(-j / gamma) (the paper's exp(-(k-1)/gamma)); a number
    is the constant itself; anything else is one clear error."""
    for gamma in (7, 15):
        c = LossCoefs.from_train(from_cli(["train.loss_decay=gamma"]).train, gamma)
        assert c.decay == gamma
        np.testing.assert_allclose(slot_weights(gamma, c.decay), np.exp(-np.arange(gamma) / gamma), rtol=1e-6)
    assert LossCoefs.from_train(from_cli([]).train, 15).decay == 4.0
    assert LossCoefs.from_train(from_cli(["train.loss_decay=2.5"]).train, 15).decay == 2.5
    with pytest.raises((ConfigError, ValueError), match="loss_decay"):
        from_cli(["train.loss_decay=paper"])
    with pytest.raises((ConfigError, ValueError), match="loss_decay"):
        from_cli(["train.loss_decay=0"])
