"""The training input pipeline: token dataset -> fixed-length records with anchors -> batches.

One fixed sequence length (no packing). Deterministic for a seed; the grain iterator's
state is checkpointed with the model, and each host reads its own shard of the records.
"""

from __future__ import annotations

from dataclasses import dataclass

import grain
import jax
import numpy as np

from dspark_jax.data.dataset import TokenDataset
from dspark_jax.data.anchors import block_valid_mask, sample_anchors


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
    return {"tokens": out_t, "loss_mask": out_m, "seq_valid": seq_valid, "anchors": anchors, "keep": keep, "block_valid": valid}


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
    """A grain IterDataset of batches (dict of numpy arrays) for this host."""
    pi = jax.process_index() if process_index is None else process_index
    pc = jax.process_count() if process_count is None else process_count
    src = grain.MapDataset.source(ds)
    if pc > 1:
        src = src[pi::pc]
    src = src.map_with_index(lambda i, r: (i, r))
    if shuffle:
        src = src.seed(spec.seed).shuffle()
    src = src.repeat(num_epochs)
    src = src.map(lambda ir: make_example(ir[1], ir[0] * pc + pi, spec))
    return src.batch(batch_size, drop_remainder=True).to_iter_dataset()
