"""Read and write safetensors files with numpy + ml_dtypes (bfloat16), no torch, no pickle.

The format is an 8-byte little-endian header length, a JSON header, then raw tensors.
Reading checks every offset against the file size, so a truncated or corrupt file is
reported as such instead of failing deep inside numpy.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES = {v: k for k, v in DTYPES.items()}


class CorruptCheckpointError(ValueError):
    pass


def read_header(path: str | Path) -> tuple[dict, int]:
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptCheckpointError(f"{path}: truncated or corrupt safetensors file "
                                         "(shorter than its 8-byte header length); re-download or re-save it")
        (n,) = struct.unpack("<Q", raw)
        if n > size - 8 or n > 100 * 2**20:
            raise CorruptCheckpointError(f"{path}: corrupt safetensors file "
                                         f"(header length {n} exceeds the file size {size}); "
                                         "re-download or re-save it")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CorruptCheckpointError(f"{path}: corrupt safetensors header ({e}); re-download or re-save it") from e
    header.pop("__metadata__", None)
    data_start = 8 + n
    for name, info in header.items():
        begin, end = info["data_offsets"]
        if info["dtype"] not in DTYPES:
            raise CorruptCheckpointError(f"{path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        expected = int(np.prod(info["shape"], dtype=np.int64)) * DTYPES[info["dtype"]].itemsize
        if end - begin != expected or data_start + end > size:
            raise CorruptCheckpointError(
                f"{path}: truncated or corrupt safetensors file (tensor '{name}' needs bytes {begin}..{end} "
                f"of a {size - data_start}-byte data section); re-download or re-save it"
            )
    return header, data_start


def load_file(path: str | Path, names=None) -> dict[str, np.ndarray]:
    """Memory-mapped numpy arrays (bfloat16 as ml_dtypes.bfloat16)."""
    header, start = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        if names is not None and name not in names:
            continue
        begin, end = info["data_offsets"]
        buf = mm[start + begin: start + end]
        out[name] = buf.view(DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def save_file(tensors: dict[str, np.ndarray], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write atomically (temporary file, then rename), so a crash never leaves half a file."""
    path = Path(path)
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(np.asarray(tensors[name]))
        if a.dtype not in CODES:
            raise ValueError(f"tensor '{name}': dtype {a.dtype} cannot be stored in safetensors")
        header[name] = {"dtype": CODES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)
