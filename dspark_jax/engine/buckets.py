"""Compiled sizes: verification buckets (tokens a round's target forward holds) and prefill buckets
(prompt lengths, one compiled prefill each). Fixed sizes keep the number of programs small."""

from __future__ import annotations

__all__ = ["default_buckets", "with_chunk_room", "prefill_buckets", "bucket_for", "tiled"]


def default_buckets(R: int, G: int, prefill_chunk: int = 0) -> tuple[int, ...]:
    """Verification bucket sizes (tokens): R, 2R, 4R, ... and R * (G + 1) + prefill_chunk (every
    round fits, with a whole prompt chunk beside it)."""
    return tuple(sorted(_doubling(R, R * (G + 1) + int(prefill_chunk))))


def _doubling(b: int, top: int) -> set[int]:
    """b, 2b, 4b, ... below top, and top."""
    out = {top}
    while b < top:
        out.add(b)
        b *= 2
    return out


def with_chunk_room(buckets, R: int, G: int, prefill_chunk: int) -> tuple[int, ...]:
    """`buckets` plus chunk-only buckets beyond the largest (doubling, then R * (G + 1) +
    prefill_chunk), so that a whole prompt chunk fits beside a full verification block. A cost
    table prices `buckets` only: the scheduler never chooses the chunk-only ones, and without
    them a joining prompt would get only what the table's largest bucket leaves."""
    buckets = tuple(sorted(set(int(b) for b in buckets)))
    top = R * (G + 1) + int(prefill_chunk)
    if not prefill_chunk or buckets[-1] >= top:
        return buckets
    return tuple(sorted(set(buckets) | _doubling(buckets[-1], top)))


def prefill_buckets(max_len: int) -> tuple[int, ...]:
    """16, 32, 64, ... below max_len, and max_len."""
    out, b = [], 16
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out + [max_len])


def bucket_for(buckets, n: int) -> int | None:
    """The smallest of `buckets` holding n tokens (None: none does)."""
    return next((b for b in buckets if b >= n), None)


def tiled(buckets, tile: int) -> tuple[int, ...]:
    """Compiled bucket sizes no smaller than `tile` rows (`target.kernels.row_tile`): on a TPU a
    program of fewer token rows is dearer, not cheaper, so a round of 1-7 tokens runs the 8-row
    program (its extra rows are padding, masked as any bucket's)."""
    return tuple(sorted({max(int(b), int(tile)) for b in buckets}))
