"""DSpark and DFlash: the parallel block backbone, with (DSpark) or without (DFlash) the
sequential Markov head and the confidence head (docs/method.md §2 and §6)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dspark_jax.decoding.sampling import all_greedy
from dspark_jax.drafter import backbone, heads
from dspark_jax.drafter.kinds.base import DrafterKind, DraftShape
from dspark_jax.drafter.losses import combine, dspark_chunked_sums
from dspark_jax.drafter.model import Drafter, resolve_config
from dspark_jax.target.kernels import row_tile


class BlockKind(DrafterKind):
    """DSpark: the semi-autoregressive drafter (backbone + Markov / RNN head + confidence head)."""

    name = "dspark"
    drafts_in_parallel = True
    has_reference_layout = True
    supports_remat = True
    decode_layout = True

    def resolve(self, target_cfg, dcfg):
        return resolve_config(target_cfg, dataclasses.replace(dcfg, kind=self.name))

    def decoder_layers(self, drafter):
        return drafter.layers

    def default_scheduling(self, drafter) -> tuple[str, str]:
        """With a confidence head: the production scheduler on its survivals, and the "known" skip
        rule (docs/scheduler.md); without one, the base kind's fixed length."""
        if drafter.dcfg.confidence_head:
            return "production", "known"
        return super().default_scheduling(drafter)

    def build(self, target_cfg, dcfg, *, rngs, param_dtype, dtype, ttt_steps: int):
        return Drafter(target_cfg, dcfg, rngs=rngs, param_dtype=param_dtype, dtype=dtype)

    def owns(self, drafter) -> bool:
        return isinstance(drafter, Drafter) and drafter.dcfg.kind == self.name

    # ---------------------------------------------------------------- train
    def loss_coefs(self, coefs):
        return coefs

    def loss(self, params, drafter, target_out, batch, *, coefs, chunk: int, ttt_steps: int, remat: bool = False):
        tokens = batch["tokens"]
        ctx = backbone.fuse_context(params, target_out.features, drafter.cfg)
        h = backbone.backbone_train(params, drafter.cfg, tokens, ctx, batch["anchors"], batch["keep"],
                                    gamma=drafter.gamma, mask_id=drafter.mask_token_id,
                                    window=drafter.dcfg.sliding_window, remat=remat)
        sums = dspark_chunked_sums(params, h, tokens, target_out.hidden, params["lm_head"], batch["anchors"],
                                   batch["block_valid"], chunk, coefs.decay, coefs.conf_detach)
        loss, metrics = combine(sums, self.loss_coefs(coefs))
        return loss, (metrics, sums)

    def activation_bytes(self, t, d, tc, seq_len: int, num_anchors: int, act_bytes: int) -> dict[str, float]:
        q = num_anchors * d.gamma
        per_layer = t.num_heads * q * (seq_len + d.gamma) * (4 + act_bytes) \
            + q * (3 * t.hidden_size + 3 * t.intermediate_size) * act_bytes
        kept = 1 if tc.remat == "drafter_layers" else d.num_layers  # recomputed layers: one alive at a time
        return {"drafter layers (kept for backward)": kept * per_layer,
                "loss chunk (q, p, grads; fp32)": 6 * min(tc.anchor_chunk, num_anchors) * d.gamma * t.vocab_size * 4}

    # ---------------------------------------------------------------- decode
    def draft_shape(self, drafter, target_cfg, gamma, layer_ids) -> DraftShape:
        G = drafter.gamma
        if gamma is not None and gamma > G:
            raise ValueError(f"gamma {gamma} exceeds the drafter's block size {G}: a {self.name} drafter drafts at "
                             f"most its trained block; use gamma <= {G}")
        return DraftShape(G, drafter.cfg, tuple(drafter.layer_ids), drafter.mask_token_id, drafter.dcfg.sliding_window)

    def init_decode(self, spec, drafter, num_slots: int, max_len: int, dtype):
        return drafter.init_cache(num_slots, max_len), jnp.zeros((num_slots, 1), dtype)

    def prefill(self, spec, dp, dcache, last, feats, hidden, tokens, start, n, rows):
        col = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        return backbone.update_context(dp, spec.draft.cfg, dcache, feats, start[:, None] + col, col < n[:, None],
                                       rows=rows), last

    def draft_hidden(self, spec, dp, dcache, anchor, pos):
        d = spec.draft
        return backbone.draft_hidden(dp, d.cfg, dcache, anchor, pos, gamma=d.G, mask_id=d.mask_id, window=d.window)

    def draft(self, spec, dp, dcache, last, anchor, pos, keys, sampling, path):
        h = self.draft_hidden(spec, dp, dcache, anchor, pos)
        # the head runs all rows at once (each with its own key and settings), at least the row
        # tile of them: its per-slot Markov product has one row per slot, and on a TPU fewer than
        # 8 rows run on the vector unit (a 1-slot Qwen3-8B draft 1.32 -> ms, docs/performance.md)
        r = anchor.shape[0]
        rows = max(r, row_tile())
        greedy = all_greedy(sampling)  # read before the padding stages the settings into the trace
        pad = lambda a: a if rows == r else jnp.concatenate([a, jnp.repeat(a[:1], rows - r, axis=0)])
        sampling = type(sampling)(*(pad(jnp.broadcast_to(jnp.asarray(x), (r,))) for x in sampling))
        toks, q, z = heads.sample_block(pad(keys), dp, pad(h), pad(anchor), sampling, path, greedy=greedy)
        return toks[:r], q[:r], z[:r], dcache

    def _forced_hidden(self, params, shape, target_out, tokens, anchors):
        # every anchor's block through the training forward: context < p, as `draft_hidden` reads it
        b, a = anchors.shape
        ctx = backbone.fuse_context(params, target_out.features, shape.cfg)
        return backbone.backbone_train(params, shape.cfg, tokens, ctx, anchors, jnp.ones((b, a), bool),
                                       gamma=shape.G, mask_id=shape.mask_id, window=shape.window)

    def forced_logits(self, params, shape, target_out, tokens, anchors):
        h = self._forced_hidden(params, shape, target_out, tokens, anchors)
        prev = jnp.take_along_axis(tokens, (anchors[..., None] + jnp.arange(shape.G)).reshape(anchors.shape[0], -1),
                                   axis=1).reshape(anchors.shape + (shape.G,))
        return heads.base_logits(params, h) + heads.head_bias_train(params, h, prev)

    def forced_drafts(self, params, shape, target_out, tokens, anchors):
        # the inference head on the forced blocks: its sequential slots see their own greedy tokens,
        # so the confidences are the engine's too, past the first rejected draft as well
        b, a = anchors.shape
        h = self._forced_hidden(params, shape, target_out, tokens, anchors)
        anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1).reshape(-1)
        toks, z = heads.greedy_block(params, h.reshape(b * a, shape.G, -1), anchor_tok)
        return toks.reshape(b, a, -1), z.reshape(b, a, -1)

    def update(self, spec, dp, dcache, last, feats, hidden, pos, drafts, acc, active):
        col = jnp.arange(feats.shape[1], dtype=jnp.int32)[None]
        valid = (col <= acc[:, None]) & active[:, None]
        return backbone.update_context(dp, spec.draft.cfg, dcache, feats, pos[:, None] + col, valid), last


class DFlashKind(BlockKind):
    """DFlash: the same backbone, slots sampled independently, no confidence head, CE loss only
    (unless the coefficients say `kind_weights=False`: then the configured weighting, whose
    confidence term is zero without the head)."""

    name = "dflash"

    def resolve(self, target_cfg, dcfg):
        return super().resolve(target_cfg, dataclasses.replace(dcfg, markov_rank=0, confidence_head=False))

    def loss_coefs(self, coefs):
        return coefs._replace(ce=1.0, l1=0.0, conf=0.0) if coefs.kind_weights else coefs


DSPARK = BlockKind()
DFLASH = DFlashKind()
