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


def _where_rows(mask, new, old):
    return jnp.where(mask.reshape(mask.shape[0], *([1] * (old.ndim - 1))), new.astype(old.dtype), old)


def sample_rows(keys, logits, sampling, path):
    """Row r's draw from logits [R, V] with its own key and settings: tokens [R], q [R, V]. Each
    row draws `sample(k_r, probs_from_params(logits_r[None], s_r))` exactly as a one-row draft
    does; only this small per-row step is vmapped (vmapping the draft itself over rows made XLA
    copy the whole drafter cache every round)."""
    def one(k, lg, s):
        q = probs_from_params(lg[None], s, path)
        return sample(k, q)[0], q[0]

    return jax.vmap(one)(keys, logits, sampling)


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
    def commit(self, dp, dcache, carried, tokens, valid, cfg):
        """Write committed positions (carry [R, T, ...], next tokens [R, T], valid prefix) into the cache."""

    @abstractmethod
    def sample(self, keys, dp, dcache, last, anchor, pos, sampling, G, cfg, path):
        """The batch's draft, row r with its own key and sampling settings (`sample_rows`):
        (tokens [R, G], q [R, G, V], cache with lengths = pos)."""

    def init_decode(self, spec, drafter, num_slots: int, max_len: int, dtype):
        return (create_cache(spec.tcfg, num_slots, max_len, dtype),
                self.carry_zeros(drafter, spec.tcfg, num_slots, dtype))

    def prefill(self, spec, dp, dcache, last, feats, hidden, tokens, plen, join):
        r, n = tokens.shape
        col = jnp.arange(n, dtype=jnp.int32)[None]
        nxt = jnp.concatenate([tokens[:, 1:], jnp.zeros((r, 1), jnp.int32)], axis=1)
        valid = (col < plen[:, None] - 2) & join[:, None]
        dcache = dcache.with_lengths(jnp.where(join, 0, dcache.lengths))
        carried = self.carry(feats, hidden)
        dcache = self.commit(dp, dcache, carried, nxt, valid, spec.tcfg)
        new_last = carried[jnp.arange(r), jnp.clip(plen - 2, 0, n - 1)]
        return dcache, _where_rows(join, new_last, last)

    def draft(self, spec, dp, dcache, last, anchor, pos, keys, sampling, path):
        toks, q, dcache = self.sample(keys, dp, dcache, last, anchor, pos, sampling, spec.G, spec.tcfg, path)
        return toks, q, jnp.zeros((anchor.shape[0], spec.G), jnp.float32), dcache

    def skip(self, spec, dp, dcache, last, anchor, pos, active):
        """A draft's first step writes position p - 1 (the carry there with the anchor x_p) and
        leaves `lengths == p`; a skipped round must write it too, or the cache falls one entry
        behind the target for every skipped round."""
        return self.commit(dp, dcache, last[:, None], anchor[:, None], active[:, None], spec.tcfg)

    def update(self, spec, dp, dcache, last, feats, hidden, pos, drafts, acc, active):
        r, g = drafts.shape
        col = jnp.arange(g, dtype=jnp.int32)[None]
        valid = (col < acc[:, None]) & active[:, None]
        carried = self.carry(feats, hidden)
        dcache = self.commit(dp, dcache, carried[:, :g], drafts, valid, spec.tcfg)
        return dcache, _where_rows(active, carried[jnp.arange(r), acc], last)
