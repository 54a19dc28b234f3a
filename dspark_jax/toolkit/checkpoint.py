"""Orbax checkpoints of a training run: any pytree of arrays (parameters, optimiser state,
step), the data-iterator state and a JSON `meta`, saved asynchronously every N steps,
keeping the last K. The drafter trainer and the embedded target build both use it.

Preemption (SIGTERM on Cloud TPU): the handler only sets a flag; the loop then asks
orbax for a step at which every host agrees to stop, saves there, waits for the write
and exits cleanly, so a restart resumes exactly.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp


class PreemptionFlag:
    """Set by SIGTERM (and SIGINT when asked); read once per step by the training loop."""

    def __init__(self, signals=(signal.SIGTERM,)):
        self.event = threading.Event()
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._old[s] = signal.signal(s, self._handler)

    def _handler(self, signum, frame):
        self.event.set()

    def restore(self):
        for s, h in self._old.items():
            signal.signal(s, h)

    def __bool__(self):
        return self.event.is_set()


class Checkpointer:
    def __init__(self, directory, every: int = 0, keep: int = 2, async_save: bool = True):
        # local paths or epath.Path("gs://...") (orbax writes GCS through tensorstore)
        self.directory = directory if "://" in str(directory) else Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def should_save(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def agreed_preemption(self, step: int, local_flag: bool) -> bool:
        """True at a step all hosts agree on after any of them was told to stop."""
        try:
            if self.manager.reached_preemption(step):
                return True
        except Exception:  # no distributed preemption service (single host)
            pass
        if jax.process_count() == 1:
            return bool(local_flag)
        from jax.experimental import multihost_utils

        return bool(np.asarray(multihost_utils.process_allgather(np.asarray(bool(local_flag)))).any())

    def save(self, step: int, state, data_iter=None, meta: dict | None = None, wait: bool = False):
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta or {})}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iter)
        self.manager.save(step, args=ocp.args.Composite(**items), force=True)
        if wait:
            self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state=None, data_iter=None):
        """(state, meta) saved at `step`; `abstract_state` (shapes / shardings, or a concrete
        tree of the same structure) lays the arrays out."""
        items = {"state": ocp.args.StandardRestore(abstract_state), "meta": ocp.args.JsonRestore()}
        if data_iter is not None:
            items["data"] = grain.checkpoint.CheckpointRestore(data_iter)
        out = self.manager.restore(step, args=ocp.args.Composite(**items))
        return out["state"], out["meta"]

    def read_meta(self, step: int) -> dict:
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self):
        self.manager.wait_until_finished()

    def close(self):
        self.manager.wait_until_finished()
        self.manager.close()
