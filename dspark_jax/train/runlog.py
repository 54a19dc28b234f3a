"""What the user sees during training: a progress bar, TensorBoard scalars, a JSONL log.

Only process 0 writes (pass enabled=False elsewhere).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tqdm.auto import tqdm


class RunLogger:
    def __init__(self, out_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self.tb = None
        self.jsonl = None
        if enabled:
            out_dir = Path(out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = open(out_dir / "log.jsonl", "a")
            try:
                from tensorboardX import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except Exception:  # TensorBoard is a convenience, never a reason to stop training
                self.tb = None

    def progress(self, total: int, initial: int = 0, disable: bool = False):
        return tqdm(total=total, initial=initial, disable=disable or not self.enabled, desc="train", unit="step",
                    dynamic_ncols=True, mininterval=1.0)

    def scalars(self, step: int, values: dict) -> None:
        if not self.enabled or not values:
            return
        rec = {"step": step, "time": time.time(), **values}
        self.jsonl.write(json.dumps(rec) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in values.items():
                if isinstance(v, (list, tuple)):
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i + 1}", x, step)
                elif isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, step)

    def close(self):
        if self.jsonl:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
