"""What Eagle3 and MTP-1 share in the engine: a one-layer KV cache of their own and a per-slot
carry of the target's view at position p - 1 (features for Eagle3, final hidden for MTP-1).

Cache convention (drafter/eagle3.py): a draft anchored at p needs `lengths == p - 1`, runs at
positions p-1.. and returns `lengths = p`; keys written beyond are dropped by that pointer.
"""

from __future__ import annotations

from abc import abstractmethod

import jax
import jax.numpy as jnp

from dspark_jax.decoding.sampling import probs_from_params, sample
from dspark_jax.drafter.eagle3 import create_cache
from dspark_jax.drafter.kinds.base import DrafterKind
from dspark_jax.parallel.sharding import constrain


def _where_rows(mask, new, old):
    return jnp.where(mask.reshape(mask.shape[0], *([1] * (old.ndim - 1))), new.astype(old.dtype), old)


def sample_rows(keys, logits, sampling, path):
    """Row r's draw from logits [R, V] with its own key and settings: tokens [R], q [R, V]. Each
    row draws `sample(k_r, probs_from_params(logits_r[None], s_r))` exactly as a one-row draft
    does; only this small per-row step is vmapped (vmapping the draft itself over rows made XLA
    copy the whole drafter cache every round)."""
    def one(k, lg, s):  # the V-wide work split over tensor as the LM head's output is
        q = constrain(probs_from_params(constrain(lg[None], (None, "act_vocab")), s, path), (None, "act_vocab"))
        return sample(k, q)[0], q[0]

    return jax.vmap(one)(keys, constrain(logits, ("batch", "act_vocab")), sampling)


class RecurrentKind(DrafterKind):
    """Subclasses give `carry` (what of the target's output they keep), `carry_zeros`, `commit`
    (write committed positions into the cache) and `sample` (draft from one row's cache)."""

    min_prompt_len = 2

    @abstractmethod
    def carry(self, feats, hidden):
        """What the kind keeps of the target's output: feats [R, T, m, H] or hidden [R, T, H]."""

    @abstractmethod
    def carry_zeros(self, drafter, target_cfg, num_slots: int, dtype):
        """The per-slot carry before any request."""

    @abstractmethod
    def commit(self, dp, dcache, carried, tokens, valid, cfg, rows=None, at=None):
        """Write committed positions (carry [R, T, ...], next tokens [R, T], valid prefix) into the
        cache at its `lengths`; `rows` [K] / `at` [K]: those slots, from those positions."""

    @abstractmethod
    def sample(self, keys, dp, dcache, last, anchor, pos, sampling, G, cfg, path):
        """The batch's draft, row r with its own key and sampling settings (`sample_rows`):
        (tokens [R, G], q [R, G, V], cache with lengths = pos)."""

    def init_decode(self, spec, drafter, num_slots: int, max_len: int, dtype):
        return (create_cache(spec.tcfg, num_slots, max_len, dtype),
                self.carry_zeros(drafter, spec.tcfg, num_slots, dtype))

    def prefill(self, spec, dp, dcache, last, feats, hidden, tokens, start, n, rows):
        """Cache entry i holds (carry at i, x_{i+1}). A chunk x_f..x_{f+n-1} commits entries f-1 ..
        f+n-2: the carry kept from the previous chunk with x_f, then its own carries with the
        tokens after them (a first chunk, f = 0, starts at entry 0); it keeps the carry at
        f+n-1. After the prompt's last chunk (f+n-1 = p-1): lengths p-1, `last` at p-1."""
        k, c = tokens.shape
        r = last.shape[0]
        carried = self.carry(feats, hidden)  # [K, C, ...]
        first = start == 0
        live = n > 0
        used = jnp.where(live, rows, r)  # rows >= R: nothing written
        prev = last[jnp.minimum(rows, r - 1)][:, None].astype(carried.dtype)
        later = jnp.concatenate([prev, carried[:, :-1]], axis=1)  # entries f-1 ..
        nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((k, 1), tokens.dtype)], axis=1)
        inputs = jnp.where(first.reshape(k, *([1] * (carried.ndim - 1))), carried, later)
        toks = jnp.where(first[:, None], nxt, tokens)
        count = jnp.where(first, n - 1, n)
        valid = (jnp.arange(c, dtype=jnp.int32)[None] < count[:, None]) & live[:, None]
        dcache = self.commit(dp, dcache, inputs, toks, valid, spec.tcfg, rows=used, at=jnp.maximum(start - 1, 0))
        keep = carried[jnp.arange(k), jnp.clip(n - 1, 0, c - 1)]
        return dcache, last.at[used].set(keep.astype(last.dtype), mode="drop")

    def draft(self, spec, dp, dcache, last, anchor, pos, keys, sampling, path):
        toks, q, dcache = self.sample(keys, dp, dcache, last, anchor, pos, sampling, spec.G, spec.tcfg, path)
        return toks, q, jnp.zeros((anchor.shape[0], spec.G), jnp.float32), dcache

    def skip(self, spec, dp, dcache, last, anchor, pos, active):
        """A draft's first step writes position p - 1 (the carry there with the anchor x_p) and
        leaves `lengths == p`; a skipped round must write it too, or the cache falls one entry
        behind the target for every skipped round."""
        return self.commit(dp, dcache, last[:, None], anchor[:, None], active[:, None], spec.tcfg)

    def plain(self, spec, dp, dcache, last, feats, hidden, pos, active):
        """No draft to commit (`skip` wrote position p - 1): the carry moves to the anchor's position."""
        return dcache, _where_rows(active, self.carry(feats, hidden)[:, 0], last)

    def update(self, spec, dp, dcache, last, feats, hidden, pos, drafts, acc, active):
        r, g = drafts.shape
        col = jnp.arange(g, dtype=jnp.int32)[None]
        valid = (col < acc[:, None]) & active[:, None]
        carried = self.carry(feats, hidden)
        dcache = self.commit(dp, dcache, carried[:, :g], drafts, valid, spec.tcfg)
        return dcache, _where_rows(active, carried[jnp.arange(r), acc], last)
