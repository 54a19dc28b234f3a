"""The paged caches' host side for one engine: which pages each slot holds (the PageAllocator)
and the page table inside the decode state, rewritten only when it changed.

A joining request gets pages for its prompt and first round; before each round every active
slot is topped up for what that round may write (or, before a compiled loop of rounds, for its
whole request), and slots that hold no request give theirs back."""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from dspark_jax.engine.page_alloc import PageAllocator
from dspark_jax.engine.state import DecodeState
from dspark_jax.target.paged_kv import PagedKVCache

__all__ = ["SlotPages"]


class SlotPages:
    def __init__(self, pages: PageAllocator, max_len: int, G: int, place: Callable[[np.ndarray], jax.Array]):
        """`place`: the host page table -> a device array laid out as the state's."""
        self.pages, self.S, self.G, self.place = pages, int(max_len), int(G), place

    def update(self, st: DecodeState, release=(), grow=None) -> DecodeState:
        """Free the pages of slots in `release`, grow slots to the token counts in `grow`
        ({slot: tokens}), and put the page table into the state if it changed."""
        version = self.pages.version
        self.pages.release_many(release)
        self.pages.grow_many({s: min(int(n), self.S) for s, n in (grow or {}).items()})
        return self._write(st, version)

    def end(self, st: DecodeState, slots) -> DecodeState:
        """The requests of `slots` are over: their pages and promises go back to the pool."""
        version = self.pages.version
        self.pages.end(slots)
        return self._write(st, version)

    def _write(self, st: DecodeState, version: int) -> DecodeState:
        if self.pages.version == version:
            return st
        dcache = st.dcache.with_page_table(self.place(self.pages.table)) \
            if isinstance(st.dcache, PagedKVCache) else st.dcache  # one buffer per cache: the state is donated
        return st._replace(cache=st.cache.with_page_table(self.place(self.pages.table)), dcache=dcache)

    def for_join(self, st: DecodeState, slots, prompts, idle=()) -> DecodeState:
        """Pages for the joining prompts and their first round; `idle` slots give theirs back."""
        return self.update(st, release=sorted(set(int(s) for s in idle) | {int(s) for s in slots}),
                           grow={int(s): len(p) + self.G for s, p in zip(slots, prompts)})

    def for_rounds(self, st: DecodeState, whole_request: bool) -> DecodeState:
        """Before rounds: inactive slots give their pages back; each active slot gets pages for the
        positions a round may write (pos .. pos + G, so pos + G + 1 tokens), or with
        `whole_request` for every round until its max_new tokens (the compiled while loop never
        returns to the host in between): pos - n_gen is constant while a request runs, so its last
        round writes below pos + (max_new - n_gen) + G."""
        pos, active, n_gen, max_new, plen = (np.asarray(x) for x in jax.device_get(
            (st.pos, st.active, st.n_gen, st.max_new, st.plen)))
        pos = np.maximum(pos, plen - 1)  # a slot still prefilling in chunks got its prompt's pages when it joined
        reach = pos + (max_new - n_gen) + self.G if whole_request else pos + self.G + 1
        return self.update(st, release=np.flatnonzero(~active).tolist(),
                           grow={int(s): int(reach[s]) for s in np.flatnonzero(active)})
