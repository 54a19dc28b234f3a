"""What Eagle3 and MTP-1 share in the engine: a one-layer KV cache of their own and a per-slot
carry of the target's view at position p - 1 (features for Eagle3, final hidden for MTP-1).

Cache convention (drafter/eagle3.py): a draft anchored at p needs `lengths == p - 1`, runs at
positions p-1.. and returns `lengths = p`; keys written beyond are dropped by that pointer.
"""

from __future__ import annotations

from abc import abstractmethod

import jax
import jax.numpy as jnp

from dspark_jax.drafter.eagle3 import create_cache
from dspark_jax.drafter.kinds.base import DrafterKind
from dspark_jax.target.kv_cache import KVCache


def _where_rows(mask, new, old):
    return jnp.where(mask.reshape(mask.shape[0], *([1] * (old.ndim - 1))), new.astype(old.dtype), old)


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
    def sample(self, key, dp, dcache, last, anchor, pos, sampling, G, cfg, path):
        """One row's draft: (tokens [1, G], q [1, G, V], cache with lengths = p)."""

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
        r = anchor.shape[0]

        def one(k, ck, cv, ln, l_r, a_r, p_r, s_r):
            c = KVCache(ck[:, None], cv[:, None], ln[None])
            t, q, c = self.sample(k, dp, c, l_r[None], a_r[None], p_r[None], s_r, spec.G, spec.tcfg, path)
            return t[0], q[0], c.k[:, 0], c.v[:, 0], c.lengths[0]

        toks, q, k, v, ln = jax.vmap(one, in_axes=(0, 1, 1, 0, 0, 0, 0, 0), out_axes=(0, 0, 1, 1, 0))(
            keys, dcache.k, dcache.v, dcache.lengths, last, anchor, pos, sampling)
        return toks, q, jnp.zeros((r, spec.G), jnp.float32), KVCache(k, v, ln)

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
