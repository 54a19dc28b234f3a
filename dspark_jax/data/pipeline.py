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

PAD_ID = 0  # what training pads records with (the pad positions are never valid)


class NoAssistantTokensError(ValueError):
    pass


@dataclass(frozen=True)
class RecordSpec:
    seq_len: int
    num_anchors: int
    gamma: int
    pad_id: int
    seed: int = 0


def pad_record(record: dict, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, loss_mask, seq_valid), each [seq_len]: the record cut or padded to the fixed length.
    The feature cache pads the same way, so its rows are the target's outputs on these tokens."""
    tokens = np.asarray(record["tokens"], np.int32)[:seq_len]
    mask = np.asarray(record["loss_mask"], bool)[:seq_len]
    n = tokens.shape[0]
    out_t = np.full((seq_len,), pad_id, np.int32)
    out_m = np.zeros((seq_len,), bool)
    out_t[:n] = tokens
    out_m[:n] = mask
    seq_valid = np.zeros((seq_len,), bool)
    seq_valid[:n] = True
    return out_t, out_m, seq_valid


def make_example(record: dict, index: int, spec: RecordSpec, features=None) -> dict:
    """Pad/truncate one record and draw its anchors from (seed, index). With `features` (a
    data.features.FeatureCache) the row also carries the target's cached `features` and `hidden`
    of record `index` (None as `index`: an empty padding row's zeros)."""
    out_t, out_m, seq_valid = pad_record(record, spec.seq_len, spec.pad_id)
    anchors, keep = sample_anchors(out_m, spec.num_anchors, spec.seed, 0 if index is None else index)
    valid = block_valid_mask(out_m, anchors, keep, spec.gamma)
    row = {"tokens": out_t, "loss_mask": out_m, "seq_valid": seq_valid,
           "anchors": anchors, "keep": keep, "block_valid": valid}
    if features is not None:  # grain numbers a record's repeats on: epoch e reads record i as e * n + i
        row.update(features.empty() if index is None else features[index % len(features)])
    return row


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


def check_features(ds, features) -> None:
    """A feature cache must hold one row per record of the dataset it is read with."""
    if features is not None and len(features) != len(ds):
        raise ValueError(f"feature cache {features.path} holds {len(features)} records but the dataset has "
                         f"{len(ds)}: it was made for other data")


def make_pipeline(ds, spec: RecordSpec, batch_size: int, *, shuffle: bool = True, num_epochs: int | None = None,
                  process_index: int | None = None, process_count: int | None = None, features=None):
    """A grain IterDataset of this host's batches (dicts of numpy arrays) of `batch_size` rows.

    One global record order (shuffled by the seed alone) cut into host-sized batches, and host p
    takes batches p, p + hosts, ...: global batch g = the hosts' g-th batches in process order =
    records [g * B, (g + 1) * B) of that order, whatever the number of hosts. So a run on 2 hosts
    x 4 chips sees the same batches as one on 1 host x 8, and each host reads only its own rows
    (the dataset is random access; nothing outside this host's batches is loaded). With `features`
    (data.features.FeatureCache) each row also carries its record's cached target outputs, looked up
    by record index, so the rows, their order and the iterator state are those without."""
    check_features(ds, features)
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    src = grain.MapDataset.source(ds).map_with_index(lambda i, r: (i, r))
    if shuffle:
        src = src.seed(spec.seed).shuffle()
    src = src.repeat(num_epochs)
    src = src.map(lambda ir: make_example(ir[1], ir[0], spec, features))
    batches = src.batch(batch_size, drop_remainder=True)
    if pc > 1:
        batches = batches[pi::pc]
    return batches.to_iter_dataset()


def heldout_batches(ds, spec: RecordSpec, batch_size: int, *, process_index: int | None = None,
                    process_count: int | None = None, features=None):
    """Every record of `ds` once, in batches of `batch_size` for this host (records i = host, host +
    hosts, ...), the last ones padded with empty examples that carry no loss and no blocks.

    Every host yields the same number of batches, ceil(ceil(n / hosts) / batch_size), computed
    from n alone: an evaluation step is a collective, so a host with one batch more than the
    others would wait for them forever, and dropping remainders would lose held-out records.
    `features`: as `make_pipeline`'s (padding rows get zeros)."""
    check_features(ds, features)
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    n = len(ds)
    num_batches = -(-(-(-n // pc)) // batch_size)
    mine = list(range(pi, n, pc))
    empty = {"tokens": np.zeros((0,), np.int32), "loss_mask": np.zeros((0,), bool)}
    for b in range(num_batches):
        idx = mine[b * batch_size:(b + 1) * batch_size]
        rows = [make_example(ds[i], i, spec, features) for i in idx]
        rows += [make_example(empty, None, spec, features)] * (batch_size - len(rows))
        yield {k: np.stack([r[k] for r in rows]) for k in rows[0]}
