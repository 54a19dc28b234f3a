"""Host-side page allocator of the paged target KV cache (plain numpy, no JAX).

A pool of `num_pages` pages of `page_size` tokens. Each of `num_slots` slots owns an ordered
list of pages, kept in `table` [num_slots, max_pages_per_slot] int32 (NO_PAGE = -1 beyond a
slot's pages): exactly the page table the device cache reads (target/paged_kv.py). A slot grows
to cover a token count by taking pages from a free list and gives all of them back when its
request ends, so the pages in use are proportional to the tokens the slots hold. Pages freed
last are reused first.

Admission by reservation: a request joins only when the pool can hold everything it may write
(its reach, in tokens) beside what the running requests were promised (`admits`, `reserve`), so a
running request never finds the pool empty; its promise ends with it (`end`). `reserved` holds
the pages promised to each slot; only this class writes it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np

__all__ = ["PageAllocator", "OutOfPagesError", "NO_PAGE"]

NO_PAGE = -1


class OutOfPagesError(ValueError):
    """The pool has fewer free pages than a request needs (a user error: the pool was sized too small)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, num_slots: int, max_pages_per_slot: int):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("num_slots", num_slots),
                        ("max_pages_per_slot", max_pages_per_slot)):
            if int(v) < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        self.num_pages, self.page_size = int(num_pages), int(page_size)
        self.num_slots, self.max_pages_per_slot = int(num_slots), int(max_pages_per_slot)
        self.reset()

    def reset(self):
        """Every slot empty, every page free."""
        self.table = np.full((self.num_slots, self.max_pages_per_slot), NO_PAGE, np.int32)
        self.owned = np.zeros((self.num_slots,), np.int64)  # pages held per slot
        self._free = list(range(self.num_pages - 1, -1, -1))  # a stack: pop() gives page 0 first
        self.peak = 0  # most pages in use at once since the last reset
        self.version = 0  # bumped by every change of `table`
        self.reserved = np.zeros((self.num_slots,), np.int64)  # pages promised to each slot's request (admission)

    # ------------------------------------------------------------ queries

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold `tokens` positions (0..tokens-1)."""
        return -(-max(int(tokens), 0) // self.page_size)

    def pages_of(self, slot: int) -> list[int]:
        return self.table[slot, : self.owned[slot]].tolist()

    def admits(self, reaches: Iterable[int], promised: int | None = None) -> int:
        """How many of `reaches` (tokens each request may write, in arrival order) join now with
        `promised` pages already promised (default: this pool's reservations): the leading run that
        fits, later ones wait (first come, first served). A reach larger than the whole pool raises
        OutOfPagesError: that request could never run."""
        budget = self.num_pages - int(self.reserved.sum() if promised is None else promised)
        n = 0
        for tokens in reaches:
            need = self.pages_for(tokens)
            if need > self.num_pages:
                raise OutOfPagesError(
                    f"a request that may write {int(tokens)} positions (prompt + max_new_tokens + one round's drafts) "
                    f"needs {need} KV pages of {self.page_size} tokens, more than the whole pool of {self.num_pages}: "
                    "build the Engine with more pages (kv_pages=(num_pages, page_size); --kv-pages NUM,SIZE on the "
                    "command line) or ask for fewer new tokens")
            if need > budget:
                break
            budget -= need
            n += 1
        return n

    # ------------------------------------------------------------ changes

    def reserve(self, slot: int, tokens: int) -> bool:
        """Promise `slot`'s new request pages for `tokens` positions when the pool can hold them
        beside the other promises -> True; else False (the request waits). Raises OutOfPagesError
        when they exceed the whole pool."""
        slot = self._slot(slot)
        if not self.admits([tokens], self.reserved.sum() - self.reserved[slot]):
            return False
        self.reserved[slot] = self.pages_for(tokens)
        return True

    def end(self, slots: Iterable[int]) -> int:
        """The requests of `slots` are over: their pages and their promises go back -> pages freed."""
        slots = [self._slot(s) for s in slots]
        self.reserved[slots] = 0
        return self.release_many(slots)

    def grow(self, slot: int, tokens: int) -> int:
        """Give `slot` pages for positions 0..tokens-1 (never shrinks) -> pages added."""
        return self.grow_many({slot: tokens})

    def grow_many(self, want: Mapping[int, int]) -> int:
        """Grow each slot to its token count, all or nothing -> pages added. Raises
        OutOfPagesError (nothing allocated) when the free list cannot cover them all."""
        need = {}
        for slot, tokens in want.items():
            slot = self._slot(slot)
            p = self.pages_for(tokens)
            if p > self.max_pages_per_slot:
                raise ValueError(f"slot {slot}: {tokens} tokens need {p} pages of {self.page_size}, more than the "
                                 f"{self.max_pages_per_slot} pages a slot's table holds")
            if p > self.owned[slot]:
                need[slot] = p - int(self.owned[slot])
        total = sum(need.values())
        if total > len(self._free):
            busy = int(np.sum(self.owned > 0))
            raise OutOfPagesError(
                f"out of KV cache pages: slot(s) {sorted(need)} need {total} more page(s) of {self.page_size} "
                f"tokens, but only {len(self._free)} of {self.num_pages} are free ({self.pages_in_use} held by "
                f"{busy} slot(s)); build the Engine with more pages (kv_pages=(num_pages, page_size); --kv-pages "
                "on the command line), fewer "
                "slots, or give shorter prompts / max_new_tokens")
        for slot, extra in need.items():
            for _ in range(extra):
                self.table[slot, self.owned[slot]] = self._free.pop()
                self.owned[slot] += 1
        if total:
            self.version += 1
            self.peak = max(self.peak, self.pages_in_use)
        return total

    def release(self, slot: int) -> int:
        """Return every page of `slot` to the free list -> pages freed."""
        slot = self._slot(slot)
        n = int(self.owned[slot])
        if n:
            self._free.extend(self.table[slot, :n][::-1].tolist())  # its first page is reused first
            self.table[slot] = NO_PAGE
            self.owned[slot] = 0
            self.version += 1
        return n

    def release_many(self, slots: Iterable[int]) -> int:
        return sum(self.release(s) for s in slots)

    def _slot(self, slot) -> int:
        slot = int(slot)
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} outside 0..{self.num_slots - 1}")
        return slot
