"""MTP-1 (DeepSeek-V3 style, docs/method.md §6): one causal layer over the target's final
hidden state and the next token, one draft token per round, CE on x_{t+2}."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspark_jax.drafter import mtp
from dspark_jax.drafter.kinds.base import DraftShape
from dspark_jax.drafter.kinds.recurrent import RecurrentKind, sample_rows


class MTP1Kind(RecurrentKind):
    name = "mtp1"
    max_gamma = 1
    reference_refusal = (
        "the engines' MTP paths load MTP layers shipped inside the target's own checkpoint for specific model "
        "families, not a standalone module; serve it with `python -m dspark_jax serve --drafter DIR`")

    def resolve(self, target_cfg, dcfg):
        return dataclasses.replace(dcfg, kind=self.name, target_layer_ids=(), num_target_features=0, num_layers=1,
                                   gamma=self.max_gamma, markov_rank=0, confidence_head=False)

    def build(self, target_cfg, dcfg, *, rngs, param_dtype, dtype, ttt_steps: int):
        return mtp.MTPDrafter(target_cfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    def owns(self, drafter) -> bool:
        return isinstance(drafter, mtp.MTPDrafter)

    def loss(self, params, drafter, target_out, batch, *, coefs, chunk: int, ttt_steps: int, remat: bool = False):
        logits = mtp.mtp_train_logits(params, batch["tokens"], target_out.hidden, batch["seq_valid"], cfg=drafter.cfg)
        loss = mtp.mtp_loss(logits, batch["tokens"], batch["loss_mask"])
        return loss, ({"loss": loss, "loss_weight": mtp.mtp_loss_denominator(batch["loss_mask"])}, None)

    def activation_bytes(self, t, d, tc, seq_len: int, num_anchors: int, act_bytes: int) -> dict[str, float]:
        s = seq_len
        return {"MTP layer + logits": t.num_heads * s * s * (4 + act_bytes) + 3 * s * t.vocab_size * 4}

    def draft_shape(self, drafter, target_cfg, gamma, layer_ids) -> DraftShape:
        if gamma not in (None, 1):
            raise ValueError(f"gamma {gamma} exceeds MTP-1's single draft token: use gamma 1")
        return DraftShape(1, target_cfg, ())

    def forced_logits(self, params, shape, target_out, tokens, anchors):
        # row t reads the target's hidden at t and x_{t+1} and predicts x_{t+2}: anchor p is row p - 1
        logits = mtp.mtp_train_logits(params, tokens, target_out.hidden, cfg=shape.cfg)
        return jnp.take_along_axis(logits, (anchors - 1)[..., None], axis=1)[:, :, None]

    def carry(self, feats, hidden):
        return hidden

    def carry_zeros(self, drafter, target_cfg, num_slots: int, dtype):
        return jnp.zeros((num_slots, target_cfg.hidden_size), dtype)

    def commit(self, dp, dcache, carried, tokens, valid, cfg, rows=None, at=None):
        return mtp.mtp_update(dp, dcache, carried, tokens, valid, cfg=cfg, rows=rows, at=at)

    def sample(self, keys, dp, dcache, last, anchor, pos, sampling, G, cfg, path):
        logits, dcache = mtp.mtp_draft_logits(dp, dcache, last, anchor, pos, cfg=cfg)
        tok, q = sample_rows(keys, logits, sampling, path)
        return tok[:, None], q[:, None], dcache


MTP1 = MTP1Kind()
