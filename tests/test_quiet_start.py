"""Commands start quietly on a host with libtpu installed (the `test` and `aot` extras) but no TPU:
none of libtpu's start-up errors about host bounds and worker hostnames, which read like a
failure; compiling for a named TPU slice without one still works, as quietly. A TPU, a user's
JAX_PLATFORMS and another accelerator's plugin are left as they are (dspark_jax/cli.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dspark_jax.cli import _other_jax_plugins, skip_absent_tpu, tpu_may_be_present

REPO = Path(__file__).resolve().parent.parent
# what libtpu prints when it starts on a host with no TPU
LIBTPU_START_ERRORS = ("Failed to find host bounds", "unexpected worker hostname", "could not determine TPU",
                       "libtpu_init_utils", "Logging before InitGoogle")

needs_libtpu_without_tpu = pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None or tpu_may_be_present() or bool(_other_jax_plugins()),
    reason="needs libtpu installed (pip install -e .[aot]) on a host with no TPU and no GPU plugin")


def _env_as_a_user_has_it() -> dict:
    """This process's environment less what the test session sets for itself (conftest.py)."""
    return {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_HOST_BOUNDS",
                                                                "TPU_WORKER_HOSTNAMES")}


def _assert_quiet(stderr: str):
    found = [m for m in LIBTPU_START_ERRORS if m in stderr]
    assert not found, f"libtpu's start-up errors in stderr ({found}):\n{stderr[-3000:]}"


@needs_libtpu_without_tpu
def test_a_command_starts_without_libtpu_errors(embedded_tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "dspark_jax", "generate", "--target", str(embedded_tiny_dir),
                           "--mode", "ar", "--max-new-tokens", "2"], input="What is 1 + 1?\n",
                          capture_output=True, text=True, env=_env_as_a_user_has_it(), timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert '"new_tokens": 2' in proc.stdout  # it ran the target on JAX's CPU backend
    _assert_quiet(proc.stderr)


@needs_libtpu_without_tpu
def test_compiling_for_a_tpu_slice_without_one_is_quiet():
    code = ("import os\n"
            "from dspark_jax.parallel.topology import slice_devices\n"
            "devices = slice_devices('v6e-8')\n"
            "print(len(devices), devices[0].platform, devices[0].device_kind)\n"
            "print(os.environ.get('TPU_WORKER_HOSTNAMES'), os.environ.get('TPU_HOST_BOUNDS'))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env_as_a_user_has_it(), timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    devices, left = proc.stdout.splitlines()
    assert devices.startswith("8 tpu ")
    assert left == "None None"  # libtpu's one-host values are gone after it started
    _assert_quiet(proc.stderr)


def test_a_users_platform_choice_is_kept(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "tpu")
    skip_absent_tpu()
    assert os.environ["JAX_PLATFORMS"] == "tpu"


@needs_libtpu_without_tpu
def test_no_tpu_here_means_cpu(monkeypatch):
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.delenv("JAX_FORCE_TPU_INIT", raising=False)
    skip_absent_tpu()
    assert os.environ["JAX_PLATFORMS"] == "cpu"


def _pci(root: Path, slot: str, vendor: str, pci_class: str):
    d = root / "sys/bus/pci/devices" / slot
    d.mkdir(parents=True)
    (d / "vendor").write_text(vendor + "\n")
    (d / "class").write_text(pci_class + "\n")


def test_tpu_is_recognised_by_device_files_and_pci(tmp_path):
    host = tmp_path / "gce_cpu_vm"  # a GCE VM: Google's gVNIC and NVMe, an Intel bridge
    _pci(host, "0000:00:00.0", "0x8086", "0x060000")
    _pci(host, "0000:00:04.0", "0x1ae0", "0x020000")
    _pci(host, "0000:00:05.0", "0x1ae0", "0x010802")
    (host / "dev/vfio").mkdir(parents=True)
    (host / "dev/vfio/vfio").touch()  # the VFIO container device, present without any TPU
    assert not tpu_may_be_present(str(host))

    v6e = tmp_path / "v6e"  # a TPU chip on PCI (processing accelerator class), bound to VFIO
    _pci(v6e, "0000:00:05.0", "0x1ae0", "0x120000")
    assert tpu_may_be_present(str(v6e))
    vfio = tmp_path / "vfio_only"
    (vfio / "dev/vfio").mkdir(parents=True)
    (vfio / "dev/vfio/0").touch()
    assert tpu_may_be_present(str(vfio))
    v4 = tmp_path / "v4"
    (v4 / "dev").mkdir(parents=True)
    (v4 / "dev/accel0").touch()
    assert tpu_may_be_present(str(v4))
