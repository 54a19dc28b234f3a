"""Launch a command as several JAX processes on this machine (`jax.distributed` on 127.0.0.1).

Each process sees `devices_per_process` fake CPU devices and finds the others through the
coordinator at 127.0.0.1:<free port> (JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID, read by `dspark_jax.parallel.distributed.maybe_initialize_distributed`). This is
how a multi-host TPU job is exercised on CPU: cross-process arrays, collectives over gloo,
per-process data shards and checkpoints, all real.

All processes are bounded in time and killed together (one dead process would leave the
others waiting in a collective forever).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class ProcessResult:
    process_id: int
    returncode: int | None  # None: killed by the launcher
    output: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(process_id: int, num_processes: int, port: int, devices_per_process: int, env=None) -> dict:
    e = dict(os.environ if env is None else env)
    flags = [f for f in e.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    e.update(JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
             JAX_PROCESS_ID=str(process_id),
             XLA_FLAGS=" ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"]))
    return e


def launch(args: list[str], *, num_processes: int = 2, devices_per_process: int = 4, timeout: float = 600,
           env: dict | None = None, cwd=None, signal_process: int | None = None, signal_when=None,
           signal_number: int = signal.SIGKILL, poll_s: float = 0.5) -> list[ProcessResult]:
    """Run ``python <args>`` as `num_processes` processes; returns their exit codes and output.

    `signal_process` / `signal_when` / `signal_number`: send that signal to that process once
    ``signal_when()`` is true. SIGKILL is a host dying mid-run: the others are then stopped too,
    as a real job's would be; SIGTERM is a preemption notice the job handles itself.
    When `timeout` passes, every process is killed and the result says so (returncode None).
    """
    port = free_port()
    logs, procs = [], []
    try:
        for i in range(num_processes):
            log = open(_tmp_log(i), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, *args], stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                          env=process_env(i, num_processes, port, devices_per_process, env),
                                          start_new_session=True))
        deadline = time.monotonic() + timeout
        killed = sent = False
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                break
            if signal_process is not None and not sent and signal_when():
                sent = True
                if signal_number == signal.SIGKILL:
                    _kill(procs[signal_process])
                    killed = True
                else:
                    procs[signal_process].send_signal(signal_number)
            if killed or any(p.returncode not in (None, 0) for p in procs):
                # a host died: the others would wait for it in their next collective
                time.sleep(2 * poll_s)
                for p in procs:
                    if p.poll() is None:
                        _kill(p)
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p)
        out = []
        for i, (p, log) in enumerate(zip(procs, logs)):
            p.wait()
            log.seek(0)
            out.append(ProcessResult(i, p.returncode if p.returncode >= 0 else None, log.read()))
            log.close()
            os.unlink(log.name)
    return out


def _tmp_log(i: int) -> str:

    fd, path = tempfile.mkstemp(prefix=f"dspark_proc{i}_", suffix=".log")
    os.close(fd)
    return path


def _kill(p: subprocess.Popen) -> None:
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
