"""The training input pipeline: token dataset -> fixed-length records with anchors -> batches.

One fixed sequence length (no packing). Deterministic for a seed and independent of the
number of hosts; the grain iterator's state is checkpointed with the model, and each host
reads only the records of its own rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import grain
import jax
import numpy as np

from dspark_jax.data.anchors import block_valid_mask, sample_anchors
from dspark_jax.data.dataset import TokenDataset


class NoAssistantTokensError(ValueError):
    pass


@dataclass(frozen=True)
class RecordSpec:
    seq_len: int
    num_anchors: int
    gamma: int
    pad_id: int
    seed: int = 0


def make_example(record: dict, index: int, spec: RecordSpec) -> dict:
    """Pad/truncate one record and draw its anchors from (seed, index)."""
    tokens = np.asarray(record["tokens"], np.int32)[: spec.seq_len]
    mask = np.asarray(record["loss_mask"], bool)[: spec.seq_len]
    n = tokens.shape[0]
    out_t = np.full((spec.seq_len,), spec.pad_id, np.int32)
    out_m = np.zeros((spec.seq_len,), bool)
    out_t[:n] = tokens
    out_m[:n] = mask
    anchors, keep = sample_anchors(out_m, spec.num_anchors, spec.seed, index)
    valid = block_valid_mask(out_m, anchors, keep, spec.gamma)
    seq_valid = np.zeros((spec.seq_len,), bool)
    seq_valid[:n] = True
    return {"tokens": out_t, "loss_mask": out_m, "seq_valid": seq_valid,
            "anchors": anchors, "keep": keep, "block_valid": valid}


def check_dataset(ds: TokenDataset, name: str = "dataset", sample: int = 64) -> None:
    n = len(ds)
    if n == 0:
        raise NoAssistantTokensError(f"{name} is empty: regenerate or point data.path at a dataset with records")
    idx = np.linspace(0, n - 1, min(sample, n)).astype(int)
    if not any(ds[int(i)]["loss_mask"].sum() >= 2 for i in idx):
        raise NoAssistantTokensError(
            f"{name} has no assistant tokens to train on (every loss mask is empty in {len(idx)} sampled records); "
            "check the chat template / regenerate the dataset so assistant turns are marked"
        )


def make_pipeline(ds, spec: RecordSpec, batch_size: int, *, shuffle: bool = True, num_epochs: int | None = None,
                  process_index: int | None = None, process_count: int | None = None):
    """A grain IterDataset of this host's batches (dicts of numpy arrays) of `batch_size` rows.

    One global record order (shuffled by the seed alone) cut into host-sized batches, and host p
    takes batches p, p + hosts, ...: global batch g = the hosts' g-th batches in process order =
    records [g * B, (g + 1) * B) of that order, whatever the number of hosts. So a run on 2 hosts
    x 4 chips sees the same batches as one on 1 host x 8, and each host reads only its own rows
    (the dataset is random access; nothing outside this host's batches is loaded)."""
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    src = grain.MapDataset.source(ds).map_with_index(lambda i, r: (i, r))
    if shuffle:
        src = src.seed(spec.seed).shuffle()
    src = src.repeat(num_epochs)
    src = src.map(lambda ir: make_example(ir[1], ir[0], spec))
    batches = src.batch(batch_size, drop_remainder=True)
    if pc > 1:
        batches = batches[pi::pc]
    return batches.to_iter_dataset()


def heldout_batches(ds, spec: RecordSpec, batch_size: int, *, process_index: int | None = None,
                    process_count: int | None = None):
    """Every record of `ds` once, in batches of `batch_size` for this host (records i = host, host +
    hosts, ...), the last ones padded with empty examples that carry no loss and no blocks.

    Every host yields the same number of batches, ceil(ceil(n / hosts) / batch_size), computed
    from n alone: an evaluation step is a collective, so a host with one batch more than the
    others would wait for them forever, and dropping remainders would lose held-out records."""
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    n = len(ds)
    num_batches = -(-(-(-n // pc)) // batch_size)
    mine = list(range(pi, n, pc))
    empty = {"tokens": np.zeros((0,), np.int32), "loss_mask": np.zeros((0,), bool)}
    for b in range(num_batches):
        idx = mine[b * batch_size:(b + 1) * batch_size]
        rows = [make_example(ds[i], i, spec) for i in idx]
        rows += [make_example(empty, 0, spec)] * (batch_size - len(rows))
        yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}
