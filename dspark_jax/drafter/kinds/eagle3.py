"""Eagle3 (DeepSpec's variant, docs/method.md §6): one layer over fused target features,
drafting token by token with its own KV cache; trained with the training-time test."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dspark_jax.drafter import eagle3 as e3
from dspark_jax.drafter.kinds.base import DraftShape
from dspark_jax.drafter.kinds.recurrent import RecurrentKind, sample_rows
from dspark_jax.drafter.model import (
    default_layer_ids,
    resolve_layer_ids,
    validate_layer_ids,
)

DEFAULT_GAMMA = 7


class Eagle3Kind(RecurrentKind):
    name = "eagle3"
    needs_target_logits = True
    reference_refusal = (
        "ours is DeepSpec's Eagle3 variant (a Qwen3 layer with q/k norm over m fused target layers, full "
        "vocabulary, no d2t map) and no vLLM / SGLang EAGLE-3 config contract for it was pinned down (their "
        "usual checkpoints, LlamaForCausalLMEagle3, are a Llama layer over 3 layers with a reduced vocabulary); "
        "serve it with `python -m dspark_jax serve --drafter DIR`")

    def resolve(self, target_cfg, dcfg):
        ids = resolve_layer_ids(target_cfg, dcfg)
        return dataclasses.replace(dcfg, kind=self.name, target_layer_ids=ids, num_target_features=len(ids),
                                   num_layers=1, markov_rank=0, confidence_head=False)

    def build(self, target_cfg, dcfg, *, rngs, param_dtype, dtype, ttt_steps: int):
        return e3.Eagle3Drafter(target_cfg, len(dcfg.target_layer_ids), rngs=rngs, ttt_steps=ttt_steps,
                                param_dtype=param_dtype, dtype=dtype)

    def owns(self, drafter) -> bool:
        return isinstance(drafter, e3.Eagle3Drafter)

    def loss(self, params, drafter, target_out, batch, *, coefs, chunk: int, ttt_steps: int, remat: bool = False):
        h = e3.eagle3_train_hidden(params, batch["tokens"], target_out.features, batch["seq_valid"], cfg=drafter.cfg,
                                   ttt_steps=ttt_steps)
        loss, per_step = e3.eagle3_loss(h, target_out.logits, batch["loss_mask"],
                                        logits_fn=lambda x: e3.eagle3_logits(params, x))
        metrics = {"loss": loss, **{f"step{i}": per_step[i] for i in range(min(3, per_step.shape[0]))}}
        return loss, (metrics, None)

    def activation_bytes(self, t, d, tc, seq_len: int, num_anchors: int, act_bytes: int) -> dict[str, float]:
        s, steps = seq_len, tc.eagle3_steps
        return {"TTT attention (all steps)": sum(t.num_heads * s * (k + 1) * s * (4 + act_bytes) for k in range(steps)),
                "TTT logits (one step, fp32)": 4 * s * t.vocab_size * 4 + s * t.vocab_size * 4}

    def draft_shape(self, drafter, target_cfg, gamma, layer_ids) -> DraftShape:
        dcfg = getattr(drafter, "dcfg", None)
        G = gamma or getattr(dcfg, "gamma", None) or DEFAULT_GAMMA
        if layer_ids is None and dcfg is not None:
            layer_ids = dcfg.target_layer_ids  # recorded with the drafter (registry.build / load)
        if layer_ids is None:
            layer_ids = default_layer_ids(target_cfg.num_layers, drafter.m)
        fl = validate_layer_ids(layer_ids, target_cfg.num_layers)
        if len(fl) != drafter.m:
            raise ValueError(f"Eagle3 drafter fuses {drafter.m} target layers but layer_ids {list(fl)} has {len(fl)}")
        return DraftShape(G, target_cfg, fl)

    def forced_logits(self, params, shape, target_out, tokens, anchors):
        # the training-time test over G steps: step s of row t predicts x_{t+s+2} from the tokens
        # before it: anchor p is row p - 1
        h = e3.eagle3_train_hidden(params, tokens, target_out.features, cfg=shape.cfg, ttt_steps=shape.G)
        rows = jnp.take_along_axis(h, (anchors - 1)[None, ..., None], axis=2)  # [G, B, A, H]
        return jnp.moveaxis(e3.eagle3_logits(params, rows), 0, 2)

    def carry(self, feats, hidden):
        return feats

    def carry_zeros(self, drafter, target_cfg, num_slots: int, dtype):
        return jnp.zeros((num_slots, drafter.m, target_cfg.hidden_size), dtype)

    def commit(self, dp, dcache, carried, tokens, valid, cfg, rows=None, at=None):
        return e3.eagle3_update(dp, dcache, carried, tokens, valid, cfg=cfg, rows=rows, at=at)

    def sample(self, keys, dp, dcache, last, anchor, pos, sampling, G, cfg, path):
        # row r's step keys are split from its key, as `eagle3_draft` splits one row's
        step_keys = jnp.moveaxis(jax.vmap(lambda k: jax.random.split(k, G))(keys), 1, 0)  # [G, R]

        def pick(ks, logits):
            tok, q = sample_rows(ks, logits, sampling, path)
            return tok, (tok, q)

        (toks, qs), dcache = e3._draft_scan(dp, dcache, last, anchor, pos, step_keys, pick, cfg)
        return jnp.moveaxis(toks, 0, 1), jnp.moveaxis(qs, 0, 1), dcache


EAGLE3 = Eagle3Kind()
