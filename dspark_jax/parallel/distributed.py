"""Connecting the hosts of a multi-host run (a TPU pod slice) before any other JAX call: every
process of the trainer calls `maybe_initialize_distributed` first; on one host it does nothing."""

from __future__ import annotations

import os

import jax


def maybe_initialize_distributed() -> None:
    """Multi-host (a TPU pod slice): connect the hosts before any other JAX call.

    On Cloud TPU VMs the workers are listed in TPU_WORKER_HOSTNAMES and
    `jax.distributed.initialize()` finds its coordinator by itself; elsewhere set
    JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID.
    """
    hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
    if len(hosts) > 1 or os.environ.get("JAX_COORDINATOR_ADDRESS"):
        env = os.environ
        explicit = {"num_processes": int(env["JAX_NUM_PROCESSES"]), "process_id": int(env["JAX_PROCESS_ID"])} \
            if "JAX_NUM_PROCESSES" in env and "JAX_PROCESS_ID" in env else {}
        jax.distributed.initialize(**explicit)
