"""What every drafter kind tells the rest of the system, in one place per kind.

A kind is a stateless, hashable object (it sits in the engine's static `Spec`, the jit cache
key). Its methods cover the drafter's whole life: resolve and build from the config, train
(the loss), and decode (its state in the engine, prefill, draft, update after verification).
Engine, trainer, planner and converter call these instead of branching on kind names;
a new kind is one file under `drafter/kinds/` plus a line in `drafter/registry.py`.

Engine conventions (see engine/state.py): slot r has committed x_0..x_p, anchor x_p at
position p; the target cache holds positions < p. `dcache` is the kind's own cache and
`last` its per-slot carry (whatever the kind needs from the previous verification).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import jax.numpy as jnp

from dspark_jax.config.schema import DrafterSection
from dspark_jax.decoding.sampling import first_argmax

__all__ = ["DraftShape", "DrafterKind"]


class DraftShape(NamedTuple):
    """The static facts of one drafter in an engine (hashable)."""

    G: int  # draft tokens per round (the compiled block)
    cfg: Any  # the kind's layer ModelConfig
    feature_layers: tuple[int, ...]  # target layers whose outputs the drafter reads
    mask_id: int = 0
    window: int | None = None


class DrafterKind(ABC):
    """Every method a kind must provide (a kind missing one cannot be instantiated). Subclasses set `name`."""

    name: str = ""
    min_prompt_len: int = 1  # tokens a prompt needs before the first draft
    needs_target_logits: bool = False  # the training loss reads the target's logits
    drafts_in_parallel: bool = False  # one drafter forward per round, whatever gamma (block drafters)
    max_gamma: int | None = None  # draft tokens per round the kind can make at most (None: any)
    supports_remat: bool = False  # `loss(..., remat=True)` recomputes the drafter layers
    has_reference_layout: bool = False  # `python -m dspark_jax convert` reads / writes it in DeepSpec's layout
    decode_layout: bool = False  # the engine lays its arrays out as drafter/decode_weights.py says
    # what `python -m dspark_jax convert` answers for a kind without a reference layout
    reference_refusal: str = "serve it with `python -m dspark_jax serve --drafter DIR`"

    def random_section(self, target_cfg, *, gamma: int, head_type: str) -> DrafterSection:
        """The drafter section of this kind's random model for `target_cfg` (drafter/random_models.py,
        timing and tests): one layer over target layer 0, a rank-8 Markov head where the kind has
        one; `resolve` makes it the kind's own."""
        return DrafterSection(kind=self.name, num_layers=1, gamma=gamma, target_layer_ids=(0,), num_target_features=1,
                              markov_rank=8, head_type=head_type, mask_token_id=target_cfg.vocab_size - 1)

    def decoder_layers(self, drafter):
        """The module holding the drafter's decoder-layer weights (q/k/v/o, gate/up/down)."""
        return drafter.layer

    def default_scheduling(self, drafter) -> tuple[str, str]:
        """(length policy, skip rule) an engine runs this drafter with when its config asks for
        neither (`EngineConfig(policy="auto")`): fixed-length verification, drafting skipped in
        rounds where the engine's cost table and the acceptance of past rounds say it does not
        pay (the "acceptance" rule, docs/scheduler.md). Kinds whose drafter has a confidence head
        schedule on it (BlockKind)."""
        return "fixed", "acceptance"

    def __hash__(self):
        return hash((type(self), self.name))

    def __eq__(self, other):
        return type(self) is type(other) and self.name == other.name

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"

    def __stable_key__(self):
        """What a kind is equal by, for the program store's keys (io/program_store.py)."""
        return (type(self), self.name)

    # ---------------------------------------------------------------- build
    @abstractmethod
    def resolve(self, target_cfg, dcfg):
        """The fully resolved DrafterSection (what checkpoints record)."""

    @abstractmethod
    def build(self, target_cfg, dcfg, *, rngs, param_dtype, dtype, ttt_steps: int):
        """A freshly initialised module for a resolved `dcfg`."""

    @abstractmethod
    def owns(self, drafter) -> bool:
        """Whether `drafter` (a module) is of this kind."""

    # ---------------------------------------------------------------- train
    @abstractmethod
    def loss(self, params, drafter, target_out, batch, *, coefs, chunk: int, ttt_steps: int, remat: bool = False):
        """(loss, (metrics, sums)); `sums` are held-out acceptance statistics (LossSums) or None.
        `remat`: recompute the drafter's layers in the backward (kinds that support it; see
        `supports_remat`)."""

    @abstractmethod
    def activation_bytes(self, t, d, tc, seq_len: int, num_anchors: int, act_bytes: int) -> dict[str, float]:
        """Analytic bytes of the kind's largest live training activations per sequence."""

    # ---------------------------------------------------------------- decode
    @abstractmethod
    def draft_shape(self, drafter, target_cfg, gamma: int | None, layer_ids) -> DraftShape:
        """The drafter's static facts in an engine; a `gamma` or `layer_ids` it cannot serve raises ValueError."""

    @abstractmethod
    def init_decode(self, spec, drafter, num_slots: int, max_len: int, dtype):
        """(dcache, last) for an engine of `num_slots` x `max_len`."""

    @abstractmethod
    def prefill(self, spec, dp, dcache, last, feats, hidden, tokens, start, n, rows):
        """After the target forwarded prompt tokens x_f..x_{f+n-1} of slot `rows[k]` (f = start[k];
        the whole prompt but its last token x_0..x_{p-1} in one call or in chunks, in order): the
        drafter's state for those positions. feats [K, C, m, H] / hidden [K, C, H] / tokens [K, C]
        of positions start.. (valid: the first n[k]); rows >= R are unused rows."""

    @abstractmethod
    def draft(self, spec, dp, dcache, last, anchor, pos, keys, sampling, path):
        """-> (tokens [R, G], q [R, G, V] (the exact distributions sampled from), z [R, G], dcache).
        `keys` [R]: per-row keys, so a request's drafts never depend on other slots."""

    def skip(self, spec, dp, dcache, last, anchor, pos, active):
        """A round that did not draft (the skip rule): what the draft would have written that the
        next round relies on. Kinds whose state comes only from `update` change nothing."""
        return dcache

    def plain(self, spec, dp, dcache, last, feats, hidden, pos, active):
        """After a round that verified each anchor alone, without a draft (feats [R, 1, m, H],
        hidden [R, 1, H] of position pos): what `update` does after a draft none of whose tokens
        was verified, on the one verified position only."""
        r = pos.shape[0]
        return self.update(spec, dp, dcache, last, feats, hidden, pos, jnp.zeros((r, 0), jnp.int32),
                           jnp.zeros((r,), jnp.int32), active)

    @abstractmethod
    def forced_logits(self, params, shape: DraftShape, target_out, tokens, anchors):
        """The drafter's logits at every anchor of whole sequences at once, teacher forced (eval/forced.py):
        tokens [B, S], the target's ForwardOut over them, anchors [B, A] (positions p >= 1) ->
        float32 [B, A, G, V], slot j's computed as if drafts 0..j-1 were tokens[p + 1..p + j]. Until
        the first draft that differs from the tokens that is what `draft` computes at anchor p."""

    def forced_drafts(self, params, shape: DraftShape, target_out, tokens, anchors):
        """Greedy drafts [B, A, G] int32 and confidence logits [B, A, G] (zeros without a head) at
        every anchor, as `forced_logits`: row (b, a) equals `draft` at T = 0 up to the first draft
        that differs from tokens[b, p + 1:], which is all the accepted length reads."""
        toks = first_argmax(self.forced_logits(params, shape, target_out, tokens, anchors)).astype(jnp.int32)
        return toks, jnp.zeros(toks.shape, jnp.float32)

    @abstractmethod
    def update(self, spec, dp, dcache, last, feats, hidden, pos, drafts, acc, active):
        """After verification: the drafter sees the target's view of [old anchor, accepted drafts].
        feats [R, G+1, m, H], hidden [R, G+1, H] of positions pos..pos+G; acc [R] accepted drafts."""
