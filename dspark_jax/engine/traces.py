"""Per round and request records: raw confidence logits, chosen length, accepted count, full-gamma flag.

Layout matches dspark_jax.calibration.sts: `conf_logits [N, G]`, `accepted [N]`; `full [N]`
marks rounds verified at the compiled block size G (only those carry uncensored labels).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

__all__ = ["Traces"]


class Traces:
    def __init__(self, G: int):
        self.G = G
        self._rows: list[tuple] = []

    def add(self, step: int, slot_req: np.ndarray, ro) -> None:
        """One round: `slot_req[r]` = request id in slot r (-1 = empty); `ro` = RoundOut (device arrays)."""
        z, l, acc, act = (np.asarray(x) for x in (ro.z, ro.lengths, ro.accepted, ro.active))
        for r in np.flatnonzero(act):
            self._rows.append((int(slot_req[r]), step, z[r].astype(np.float32), int(l[r]), int(acc[r])))

    def __len__(self) -> int:
        return len(self._rows)

    def arrays(self) -> dict[str, np.ndarray]:
        n, g = len(self._rows), max(self.G, 1)
        z = np.stack([r[2] for r in self._rows]) if n else np.zeros((0, g), np.float32)
        length = np.asarray([r[3] for r in self._rows], np.int64)
        return {"request": np.asarray([r[0] for r in self._rows], np.int64),
                "round": np.asarray([r[1] for r in self._rows], np.int64),
                "conf_logits": z, "length": length,
                "accepted": np.asarray([r[4] for r in self._rows], np.int64),
                "full": length == self.G}

    def save(self, path) -> Path:
        """`.npz` (arrays) or `.jsonl` (one record per round and request)."""
        path = Path(path)
        a = self.arrays()
        if path.suffix == ".npz":
            np.savez(path, **a)
        else:
            with path.open("w") as f:
                for i in range(len(a["length"])):
                    f.write(json.dumps({"request": int(a["request"][i]), "round": int(a["round"][i]),
                                        "conf_logits": [float(x) for x in a["conf_logits"][i]],
                                        "length": int(a["length"][i]), "accepted": int(a["accepted"][i]),
                                        "full": bool(a["full"][i])}) + "\n")
        return path
