"""What a person watching training keeps: a JSONL log and TensorBoard scalars (the bar: console.py).

Only process 0 writes on multi-host runs (the others pass no path).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["MetricsLogger", "read_jsonl"]


class MetricsLogger:
    """One JSON object per line (seconds since the logger started under "time"), optionally the
    same scalars in TensorBoard; `path=None` logs nowhere."""

    def __init__(self, path=None, tensorboard_dir=None):
        self._fh, self.tb = None, None
        self._t0 = time.time()
        if path is not None:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(path, "a", encoding="utf-8")
        if tensorboard_dir is not None:
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(tensorboard_dir))
            except Exception:  # TensorBoard is a convenience, never a reason to stop training
                self.tb = None

    def log(self, record: dict[str, Any]) -> None:
        """Write `record` (arrays and numpy scalars become plain numbers / lists); a "step"
        entry is also the TensorBoard step of its scalars."""
        if self._fh is None or not record:
            return
        rec = {k: _plain(v) for k, v in record.items()}
        self._fh.write(json.dumps({"time": round(time.time() - self._t0, 3), **rec}) + "\n")
        self._fh.flush()
        if self.tb is not None and "step" in rec:
            for k, v in rec.items():
                if isinstance(v, list):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i + 1}", x, rec["step"])
                elif isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(k, v, rec["step"])

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _plain(v):
    if isinstance(v, (np.generic, np.ndarray)) or hasattr(v, "dtype"):
        a = np.asarray(v)
        return a.item() if a.ndim == 0 else a.tolist()
    return v


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
