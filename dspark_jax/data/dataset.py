"""Random-access on-disk token dataset (memory-mapped shards) for grain.

Layout of a dataset directory::

    tokens.bin     int32, all records concatenated
    loss_mask.bin  uint8, same length as tokens.bin
    offsets.npy    int64[n + 1], record i = [offsets[i], offsets[i+1])
    meta.json      {"count", "num_tokens", "vocab_size", "tokenizer_hash", "info", "format"}

Why: memory maps give O(1) random access without loading the data, which is what a
shuffling ``grain.MapDataset.source`` needs. Writes go to ``<dir>.partial`` and are
renamed into place on close, so a reader never sees a half-written dataset; the
partial directory keeps an append-only offsets log so an interrupted write can resume
after its last complete record.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

FORMAT = "dspark-tokens-v1"
_FILES = ("tokens.bin", "loss_mask.bin", "offsets.npy", "meta.json")
_LOG = "offsets.log"  # int64 end offset appended per complete record (partial dirs only)


def _partial_dir(path: Path) -> Path:
    return path.with_name(path.name + ".partial")


def recorded_info(path, key: str) -> dict | None:
    """`info[key]` of the dataset at `path` or of its interrupted write (what a resumed run must match)."""
    path = Path(path)
    for f in (_partial_dir(path) / "meta.partial.json", path / "meta.json"):
        if f.is_file():
            return json.loads(f.read_text()).get("info", {}).get(key)
    return None


class DatasetWriter:
    """Append records, then ``close()`` to publish atomically.

    ``overwrite=True`` replaces an existing dataset on close; ``resume=True`` continues an
    interrupted write (or appends to a finished dataset). ``len(writer)`` is the number of
    records already stored, so a producer can skip that many inputs when resuming.
    """

    def __init__(self, path, *, overwrite: bool = False, resume: bool = False,
                 vocab_size: int | None = None, tokenizer_hash: str | None = None, info: dict | None = None):
        self.path = Path(path)
        self.tmp = _partial_dir(self.path)
        self.overwrite = overwrite
        self.meta = {"format": FORMAT, "vocab_size": vocab_size, "tokenizer_hash": tokenizer_hash,
                     "info": dict(info or {})}
        if self.path.exists() and not (overwrite or resume):
            raise FileExistsError(f"dataset {self.path} already exists (pass overwrite=True to replace it)")
        if resume and not self.tmp.exists() and self.path.exists():
            self._reopen_finished()
        if resume and self.tmp.exists():
            self._recover()
        else:
            if self.tmp.exists():
                shutil.rmtree(self.tmp)
            self.tmp.mkdir(parents=True)
            self._ends = [0]
        (self.tmp / "meta.partial.json").write_text(json.dumps(self.meta))
        self._tok = open(self.tmp / "tokens.bin", "ab")
        self._mask = open(self.tmp / "loss_mask.bin", "ab")
        self._log = open(self.tmp / _LOG, "ab")
        self._closed = False

    def _reopen_finished(self):
        """Turn a published dataset back into a partial one to append to it."""
        old = TokenDataset(self.path)
        for k in ("vocab_size", "tokenizer_hash"):
            if self.meta[k] is None:
                self.meta[k] = old.meta.get(k)
            elif old.meta.get(k) not in (None, self.meta[k]):
                raise ValueError(f"{self.path / 'meta.json'}: {k} {old.meta.get(k)!r} != {self.meta[k]!r}")
        self.meta["info"] = {**old.meta.get("info", {}), **self.meta["info"]}
        offsets = old.offsets.copy()
        del old
        os.rename(self.path, self.tmp)  # until close() it is an ordinary partial write
        offsets[1:].astype("<i8").tofile(self.tmp / _LOG)
        for f in ("offsets.npy", "meta.json"):
            (self.tmp / f).unlink()

    def _recover(self):
        """Keep complete records of an interrupted write; truncate any torn tail."""
        log = self.tmp / _LOG
        raw = log.read_bytes() if log.exists() else b""
        ends = np.frombuffer(raw[: len(raw) // 8 * 8], dtype="<i8")
        ntok = min((self.tmp / f).stat().st_size // s if (self.tmp / f).exists() else 0
                   for f, s in (("tokens.bin", 4), ("loss_mask.bin", 1)))
        n = len(ends)
        while n and (ends[n - 1] > ntok or (n > 1 and ends[n - 1] < ends[n - 2])):
            n -= 1
        self._ends = [0] + [int(e) for e in ends[:n]]
        end = self._ends[-1]
        for f, s in (("tokens.bin", 4), ("loss_mask.bin", 1)):
            with open(self.tmp / f, "ab") as fh:
                fh.truncate(end * s)
        with open(log, "ab") as fh:
            fh.truncate(n * 8)
        saved = self.tmp / "meta.partial.json"
        if saved.exists():
            old = json.loads(saved.read_text())
            for k in ("vocab_size", "tokenizer_hash"):
                if self.meta[k] is None:
                    self.meta[k] = old.get(k)
            self.meta["info"] = {**old.get("info", {}), **self.meta["info"]}

    def __len__(self) -> int:
        return len(self._ends) - 1

    def add(self, tokens, loss_mask) -> None:
        tokens = np.asarray(tokens)
        loss_mask = np.asarray(loss_mask)
        if tokens.ndim != 1 or tokens.shape != loss_mask.shape:
            raise ValueError(f"tokens {tokens.shape} and loss_mask {loss_mask.shape} must be equal 1-D shapes")
        if self._closed:
            raise ValueError("writer is closed")
        self._tok.write(tokens.astype("<i4").tobytes())
        self._mask.write(loss_mask.astype(np.uint8).tobytes())
        self._tok.flush()
        self._mask.flush()
        end = self._ends[-1] + len(tokens)
        self._log.write(np.int64(end).astype("<i8").tobytes())  # record is complete only now
        self._log.flush()
        self._ends.append(end)

    def _close_files(self):
        for f in (self._tok, self._mask, self._log):
            f.close()

    def close(self) -> Path:
        """Write offsets + meta and rename ``<dir>.partial`` to ``<dir>``."""
        if self._closed:
            return self.path
        self._close_files()
        self._closed = True
        np.save(self.tmp / "offsets.npy", np.asarray(self._ends, dtype=np.int64))
        meta = {**self.meta, "count": len(self), "num_tokens": self._ends[-1]}
        (self.tmp / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True))
        (self.tmp / _LOG).unlink()
        (self.tmp / "meta.partial.json").unlink(missing_ok=True)
        if self.path.exists():
            if not self.overwrite:
                raise FileExistsError(f"dataset {self.path} appeared while writing; left data in {self.tmp}")
            shutil.rmtree(self.path)
        os.rename(self.tmp, self.path)
        return self.path

    def abandon(self) -> None:
        """Stop writing but keep ``<dir>.partial`` for a later ``resume=True``."""
        if not self._closed:
            self._close_files()
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abandon()


class TokenDataset:
    """Read-only random access: ``ds[i] -> {"tokens": int32[L], "loss_mask": bool[L]}``."""

    def __init__(self, path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"dataset directory {self.path} not found")
        for f in _FILES:
            if not (self.path / f).is_file():
                raise FileNotFoundError(f"dataset file {self.path / f} is missing")
        try:
            self.meta = json.loads((self.path / "meta.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{self.path / 'meta.json'}: corrupt JSON ({e})") from None
        try:
            self.offsets = np.load(self.path / "offsets.npy", allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any parse failure means a corrupt file
            raise ValueError(f"{self.path / 'offsets.npy'}: unreadable ({e})") from None
        o = self.offsets
        if o.ndim != 1 or o.dtype != np.int64 or len(o) < 1 or o[0] != 0 or np.any(np.diff(o) < 0):
            raise ValueError(f"{self.path / 'offsets.npy'}: not a non-decreasing int64 array starting at 0")
        if self.meta.get("count") != len(o) - 1:
            raise ValueError(f"{self.path / 'meta.json'}: count {self.meta.get('count')} != "
                             f"{len(o) - 1} records in offsets.npy")
        n = int(o[-1])
        for f, s in (("tokens.bin", 4), ("loss_mask.bin", 1)):
            size = (self.path / f).stat().st_size
            if size != n * s:
                raise ValueError(f"{self.path / f}: size {size} bytes, expected {n * s} ({n} tokens)")
        self._maps = None

    def _open(self):
        if self._maps is None:
            n = int(self.offsets[-1])
            if n == 0:
                self._maps = (np.zeros(0, np.int32), np.zeros(0, np.uint8))
            else:
                self._maps = (np.memmap(self.path / "tokens.bin", dtype="<i4", mode="r", shape=(n,)),
                              np.memmap(self.path / "loss_mask.bin", dtype=np.uint8, mode="r", shape=(n,)))
        return self._maps

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        n = len(self)
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record {i} out of range for dataset of {n}")
        tok, mask = self._open()
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return {"tokens": np.array(tok[a:b], dtype=np.int32), "loss_mask": mask[a:b].astype(np.bool_)}

    def __getstate__(self):  # memmaps are reopened lazily in worker processes
        return {**self.__dict__, "_maps": None}

    def __repr__(self) -> str:
        return f"TokenDataset({str(self.path)!r}, n={len(self)})"
