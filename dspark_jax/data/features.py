"""The frozen target's drafter inputs, computed once per token dataset and read from disk.

A drafter trains on a fixed token dataset against a frozen target, so the target's outputs for
each record are the same in every epoch: computing them once removes the target forward from
every training step. Layout of a cache directory::

    shard-00000.npy  bfloat16 (stored as uint16) [records, seq_len, m + 1, H]: slots 0..m-1 are
                     the feature layers' outputs (`ForwardOut.features`), slot m the final hidden
                     (`ForwardOut.hidden`), of records [k * shard_records, (k + 1) * shard_records)
    meta.json        the identity (target fingerprint, layer ids, dataset hash, seq_len, pad id,
                     dtype), its hash, the shape, and the shards done

Each record is padded to seq_len as the training pipeline pads it (data/pipeline.py `pad_record`),
so a cached row is exactly what the online forward sees. Shards are written to a temporary name
and renamed, and recorded in meta.json only then: an interrupted write resumes after its last
complete shard. A cache made for another target, layer set or dataset, or one with a damaged
shard, is refused with what to do; nothing on disk is deleted or overwritten silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from dspark_jax.console import progress_bar
from dspark_jax.data.pipeline import pad_record
from dspark_jax.drafter.frozen import target_fingerprint
from dspark_jax.parallel.sharding import host_arrays

log = logging.getLogger(__name__)

FORMAT = "dspark-features-v1"
DTYPE = "bfloat16"
_DATA_FILES = ("offsets.npy", "tokens.bin", "loss_mask.bin")  # a TokenDataset's contents
_HASH_CHUNK = 1 << 24


class FeatureCacheError(ValueError):
    """The cache on disk cannot be used as it is; the message says why and what to do."""


@dataclass(frozen=True)
class FeatureIdentity:
    """Everything the cached numbers depend on: two caches with equal identities hold equal arrays."""

    target: str  # drafter.frozen.target_fingerprint
    layers: tuple[int, ...]  # target layer ids whose outputs are the drafter's features
    data: str  # dataset_hash of the token dataset
    seq_len: int
    pad_id: int
    dtype: str = DTYPE

    def key(self) -> str:
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:16]

    def as_json(self) -> dict:
        return {**dataclasses.asdict(self), "layers": list(self.layers)}


def dataset_hash(ds) -> str:
    """Hash of a token dataset's contents: its files when it has them (TokenDataset), else its records."""
    h = hashlib.sha256()
    root = getattr(ds, "path", None)
    if root is not None and all((Path(root) / f).is_file() for f in _DATA_FILES):
        for name in _DATA_FILES:
            with open(Path(root) / name, "rb") as fh:
                while chunk := fh.read(_HASH_CHUNK):
                    h.update(chunk)
        return h.hexdigest()[:16]
    for i in range(len(ds)):
        rec = ds[i]
        h.update(np.int64(len(rec["tokens"])).tobytes())
        h.update(np.asarray(rec["tokens"], "<i4").tobytes())
        h.update(np.asarray(rec["loss_mask"], np.uint8).tobytes())
    return h.hexdigest()[:16]


def default_dir(data_path) -> Path:
    """Where a dataset's cache lives unless `data.features_path` says otherwise."""
    return Path(data_path) / "features"


def bytes_per_token(num_layers: int, hidden_size: int) -> int:
    """m x H x 2 (features) + H x 2 (hidden), in bfloat16."""
    return (num_layers + 1) * hidden_size * 2


def _shard_name(k: int) -> str:
    return f"shard-{k:05d}.npy"


def _fix(path: Path) -> str:
    return (f"point data.features_path at another directory, or delete {path} and rerun "
            "`python -m dspark_jax features CONFIG` to compute it again")


def _check_identity(path: Path, meta: dict, identity: FeatureIdentity) -> None:
    """One message naming the first difference between the cache's identity and the wanted one."""
    if meta.get("format") != FORMAT:
        raise FeatureCacheError(f"{path} is not a feature cache of format {FORMAT} "
                                f"(meta.json says {meta.get('format')!r}): {_fix(path)}")
    have = meta.get("identity", {})
    want = identity.as_json()
    what = {"target": "another target (fingerprint {have}, this target {want})",
            "layers": "another feature layer set ({have}, the drafter reads {want})",
            "data": "other data (dataset hash {have}, this dataset {want})",
            "seq_len": "another data.seq_len ({have}, this run {want})",
            "pad_id": "another pad id ({have}, this run {want})",
            "dtype": "another dtype ({have}, this run {want})"}
    for field, text in what.items():
        if have.get(field) != want[field]:
            raise FeatureCacheError(f"feature cache {path} was made for "
                                    f"{text.format(have=have.get(field), want=want[field])}: {_fix(path)}")


def _read_header(file: Path) -> tuple[tuple[int, ...], int]:
    """(shape, data offset) of a .npy file's header."""
    with open(file, "rb") as fh:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, _ = read(fh)
        return shape, fh.tell()


def _check_shard(path: Path, k: int, shape: tuple[int, ...]) -> None:
    """A shard recorded as done must be there whole, with the shape it was written with."""
    file = path / _shard_name(k)
    if not file.is_file():
        raise FeatureCacheError(f"feature shard {file} is missing though {path / 'meta.json'} records it as done: "
                                f"{_fix(path)}")
    try:
        got, offset = _read_header(file)
    except (ValueError, OSError, SyntaxError) as e:
        raise FeatureCacheError(f"feature shard {file} is truncated or damaged ({e}): {_fix(path)}") from None
    want = offset + int(np.prod(shape)) * 2
    size = file.stat().st_size
    if tuple(got) != tuple(shape) or size != want:
        raise FeatureCacheError(f"feature shard {file} is truncated or damaged ({size} bytes of shape {tuple(got)}, "
                                f"expected {want} bytes of shape {tuple(shape)}): {_fix(path)}")


class FeatureCache:
    """Read-only random access: `cache[i] -> {"features": bf16[S, m, H], "hidden": bf16[S, H]}`.

    Opening checks the identity and every shard's size, so a damaged cache fails before training."""

    def __init__(self, path, identity: FeatureIdentity):
        self.path = Path(path)
        meta_file = self.path / "meta.json"
        if not meta_file.is_file():
            raise FileNotFoundError(f"no feature cache at {self.path} (no meta.json): "
                                    "run `python -m dspark_jax features CONFIG` or train with data.features=cache")
        self.meta = json.loads(meta_file.read_text())
        _check_identity(self.path, self.meta, identity)
        self.count, self.per_shard = int(self.meta["count"]), int(self.meta["shard_records"])
        self.num_shards = -(-self.count // self.per_shard)
        missing = sorted(set(range(self.num_shards)) - set(self.meta["done"]))
        if missing:
            raise FeatureCacheError(f"feature cache {self.path} is incomplete ({len(missing)} of {self.num_shards} "
                                    "shards not written): rerun `python -m dspark_jax features CONFIG` to finish it")
        self.row_shape = (identity.seq_len, len(identity.layers) + 1, int(self.meta["hidden_size"]))
        for k in range(self.num_shards):
            _check_shard(self.path, k, self._shape(k))
        self._maps: dict[int, np.ndarray] = {}

    def _shape(self, k: int) -> tuple[int, ...]:
        return (min(self.per_shard, self.count - k * self.per_shard), *self.row_shape)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i):
        i = int(i)
        if not 0 <= i < self.count:
            raise IndexError(f"record {i} out of range for a feature cache of {self.count}")
        k, j = divmod(i, self.per_shard)
        if k not in self._maps:
            self._maps[k] = np.load(self.path / _shard_name(k), mmap_mode="r")
        row = np.asarray(self._maps[k][j]).view(ml_dtypes.bfloat16)
        return {"features": row[:, :-1], "hidden": row[:, -1]}

    def empty(self) -> dict:
        """The arrays of a padding row (no record): zeros."""
        z = np.zeros(self.row_shape, ml_dtypes.bfloat16)
        return {"features": z[:, :-1], "hidden": z[:, -1]}

    def __getstate__(self):  # memmaps are reopened lazily in worker processes
        return {**self.__dict__, "_maps": {}}


def _open_for_writing(path: Path, identity: FeatureIdentity, count: int, per_shard: int, hidden: int) -> dict:
    """The meta of the cache at `path` (checked against `identity`), or a new one for an empty directory."""
    meta_file = path / "meta.json"
    if meta_file.is_file():
        meta = json.loads(meta_file.read_text())
        _check_identity(path, meta, identity)
        return meta
    if path.exists() and any(f for f in path.iterdir() if not f.name.endswith(".tmp")):
        raise FeatureCacheError(f"{path} holds files but no meta.json, so it is not a feature cache: "
                                "point data.features_path at an empty or new directory")
    path.mkdir(parents=True, exist_ok=True)
    return {"format": FORMAT, "key": identity.key(), "identity": identity.as_json(), "count": count,
            "shard_records": per_shard, "seq_len": identity.seq_len, "num_layers": len(identity.layers),
            "hidden_size": hidden, "done": []}


def _write_meta(path: Path, meta: dict) -> None:
    tmp = path / "meta.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    os.replace(tmp, path / "meta.json")


def _write_shard(path: Path, k: int, rows: np.ndarray) -> None:
    """Whole or not at all: a temporary file, flushed, then renamed."""
    tmp = path / (_shard_name(k) + ".tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, rows)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path / _shard_name(k))


def _forward_fn(target, layers: tuple[int, ...]):
    """(tokens, valid) [B, S] -> uint16 [B, S, m + 1, H]: the bf16 bits of features and hidden."""
    graphdef, state = nnx.split(target)

    @jax.jit
    def run(state, tokens, valid):
        out = nnx.merge(graphdef, state)(tokens, valid=valid, feature_layers=layers, return_logits=False)
        rows = jnp.concatenate([out.features, out.hidden[:, :, None]], axis=2).astype(jnp.bfloat16)
        return jax.lax.bitcast_convert_type(rows, jnp.uint16)

    return lambda tokens, valid: run(state, tokens, valid)


def write_features(target, ds, path, identity: FeatureIdentity, *, shard_records: int = 256, batch_size: int = 8,
                   progress: bool = True, mesh=None, on_shard=None) -> dict:
    """Compute and store the cache of every record of `ds`, continuing an interrupted write.

    `target`: a TargetModel (on `mesh` if given); `on_shard(k)` is called after shard k is stored.
    Every process runs the forward (a collective on a multi-host mesh); process 0 writes, so on
    several hosts `path` must be a filesystem they share. Returns {"written": shard ids, "skipped": ids}."""
    path = Path(path)
    if not identity.layers:
        raise ValueError("the drafter reads no target layers: there are no features to cache")
    writer = jax.process_index() == 0
    meta = _open_for_writing(path, identity, len(ds), shard_records, target.cfg.hidden_size)
    if writer and not (path / "meta.json").is_file():  # from now on the directory is this cache's
        _write_meta(path, meta)
    per_shard, count = int(meta["shard_records"]), int(meta["count"])
    if count != len(ds):
        raise FeatureCacheError(f"feature cache {path} holds {count} records but the dataset has {len(ds)}: "
                                f"{_fix(path)}")
    num_shards = -(-count // per_shard)
    done = set(meta["done"])
    row_shape = (identity.seq_len, len(identity.layers) + 1, target.cfg.hidden_size)
    for k in sorted(done):
        _check_shard(path, k, (min(per_shard, count - k * per_shard), *row_shape))
    forward = _forward_fn(target, identity.layers)
    todo = [k for k in range(num_shards) if k not in done]
    bar = progress_bar(total=count, initial=count - sum(min(per_shard, count - k * per_shard) for k in todo),
                       desc="features", unit="record", enabled=progress and writer)
    try:
        for k in todo:
            idx = list(range(k * per_shard, min((k + 1) * per_shard, count)))
            rows = np.empty((len(idx), *row_shape), np.uint16)
            for b0 in range(0, len(idx), batch_size):
                chunk = idx[b0:b0 + batch_size]
                padded = [pad_record(ds[i], identity.seq_len, identity.pad_id) for i in chunk]
                padded += [padded[-1]] * (batch_size - len(chunk))  # one compiled shape
                tokens = np.stack([p[0] for p in padded])
                valid = np.stack([p[2] for p in padded])
                with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):  # sets it when called
                    rows[b0:b0 + len(chunk)] = host_arrays(forward(tokens, valid))[:len(chunk)]
                bar.update(len(chunk))
            if writer:
                if (path / _shard_name(k)).exists():  # renamed into place, then interrupted before meta.json
                    log.info(f"{path / _shard_name(k)} is not recorded as done in meta.json: written again")
                _write_shard(path, k, rows)
                meta["done"] = sorted({*meta["done"], k})
                _write_meta(path, meta)
            if on_shard is not None:
                on_shard(k)
    finally:
        bar.close()
    if jax.process_count() > 1:  # the other hosts open the cache only once process 0 has written it
        multihost_utils.sync_global_devices("dspark_jax feature cache")
    if todo:
        log.info(f"feature cache {path}: {len(todo)} shards written, {len(done)} kept "
                 f"({bytes_per_token(len(identity.layers), target.cfg.hidden_size)} bytes per token)")
    return {"written": todo, "skipped": sorted(done)}


def ensure_features(target, ds, path, *, layers, seq_len: int, pad_id: int, progress: bool = True, mesh=None,
                    shard_records: int = 256, batch_size: int = 8) -> FeatureCache:
    """The cache of `ds` for this target and layer set: computed where missing, then opened."""
    identity = FeatureIdentity(target=target_fingerprint(target), layers=tuple(int(i) for i in layers),
                               data=dataset_hash(ds), seq_len=int(seq_len), pad_id=int(pad_id))
    write_features(target, ds, path, identity, shard_records=shard_records, batch_size=batch_size,
                   progress=progress, mesh=mesh)
    return FeatureCache(path, identity)
