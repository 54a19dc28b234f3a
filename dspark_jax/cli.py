"""What every command does with a user's mistake: one line on stderr, exit status 2.

Missing files, bad configs, checkpoints that do not fit and refused requests are raised as
ValueError / FileNotFoundError / FileExistsError / ConnectionError subclasses with a message
that names the problem and the fix; a traceback would only bury it. ``DSPARK_JAX_TRACEBACK=1``
shows the traceback anyway (for bug reports).

Also how a command starts on a host with libtpu (the `test`, `aot` and `tpu` extras) but no TPU:
without a TPU, libtpu's start-up prints errors about host bounds and worker hostnames that read
like a failure (`skip_absent_tpu`, `quiet_libtpu_start`).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import importlib.metadata
import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, ConnectionError)


def report_user_errors(main):
    """Decorate a ``main(argv) -> int``: user errors become ``error: <message>`` and status 2."""
    @functools.wraps(main)
    def wrapped(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except USER_ERRORS as e:
            if os.environ.get("DSPARK_JAX_TRACEBACK"):
                raise
            print(f"error: {e}", file=sys.stderr)
            return 2

    return wrapped


# TPU chips appear as /dev/accel* (v2-v4) or as VFIO groups (/dev/vfio/<n>, v5e and later), and as
# PCI devices of Google's vendor id; GCE's virtual NIC (gVNIC) and NVMe disks carry that id too,
# under the network (0x02) and storage (0x01) PCI classes.
_TPU_DEVICE_FILES = ("dev/accel*", "dev/vfio/[0-9]*")
_GOOGLE_PCI_VENDOR = "0x1ae0"
_NOT_TPU_PCI_CLASSES = ("0x01", "0x02")


def tpu_may_be_present(root: str = "/") -> bool:
    """Whether this host (its file system at `root`) may have a TPU: a TPU device file, or a Google
    PCI device that is neither a network nor a storage controller (one that cannot be read counts
    as a TPU)."""
    if any(glob.glob(os.path.join(root, pattern)) for pattern in _TPU_DEVICE_FILES):
        return True
    for vendor in glob.glob(os.path.join(root, "sys/bus/pci/devices/*/vendor")):
        try:
            if Path(vendor).read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            pci_class = Path(vendor).with_name("class").read_text().strip()
        except OSError:
            return True
        if not pci_class.startswith(_NOT_TPU_PCI_CLASSES):
            return True
    return False


def _libtpu_installed() -> bool:
    return bool(os.environ.get("TPU_LIBRARY_PATH")) or importlib.util.find_spec("libtpu") is not None


def _other_jax_plugins() -> list[str]:
    """PJRT plugins besides the TPU's (a GPU's), which a JAX_PLATFORMS of cpu would hide."""
    names = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    spec = importlib.util.find_spec("jax_plugins")  # the namespace package jax also searches
    for folder in (spec.submodule_search_locations or []) if spec else []:
        names += [p.name for p in Path(folder).iterdir() if not p.name.startswith(("_", "."))]
    return [n for n in names if "tpu" not in n.lower()]


def skip_absent_tpu() -> None:
    """Where libtpu is installed but this host has no TPU, and nobody chose JAX's platforms: set
    JAX_PLATFORMS=cpu, so JAX does not start libtpu looking for a TPU that is not there. Call it
    before jax is imported. It leaves JAX to choose where a TPU may be present, where JAX_PLATFORMS
    or JAX_FORCE_TPU_INIT is set, and where another accelerator's plugin (a GPU's) is installed.
    Compiling for a TPU slice without one still works: parallel/topology.py loads libtpu itself."""
    if os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_FORCE_TPU_INIT") or not _libtpu_installed():
        return
    if tpu_may_be_present() or _other_jax_plugins():
        return
    os.environ["JAX_PLATFORMS"] = "cpu"
    logger.debug("libtpu is installed but this host has no TPU: JAX_PLATFORMS=cpu")


# Where libtpu runs with no TPU (compiling for a named slice), it looks for this host's place in a
# TPU slice and, finding none, prints errors; these values describe a one-host slice, which is all
# a compile-only process needs (the compiled programs are the named topology's either way).
_COMPILE_ONLY_LIBTPU_ENV = {"TPU_HOST_BOUNDS": "1,1,1", "TPU_WORKER_HOSTNAMES": "localhost"}


@contextlib.contextmanager
def quiet_libtpu_start():
    """Around the first call that loads libtpu to compile only (jax's `get_topology_desc`): on a
    host with no TPU, the variables libtpu reads at start-up describe a one-host slice, so it starts
    without errors; they are unset again afterwards (jax.distributed and the TPU launch scripts read
    TPU_WORKER_HOSTNAMES). Where a TPU may be present, or the variables are set, nothing changes."""
    if tpu_may_be_present():
        yield
        return
    added = {k: v for k, v in _COMPILE_ONLY_LIBTPU_ENV.items() if k not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


# Flags shared by the commands, defined here (no jax import) so `--help` stays fast.
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


def add_dtype_argument(ap) -> None:
    """`--dtype auto|float32|bfloat16` for every command that loads a target."""
    ap.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                    help="weights and compute dtype of the target (default auto: bfloat16 for a checkpoint stored in "
                         "bfloat16, else float32; an 8B model is 16 GB in bf16, 32 GB in float32)")


def add_mesh_argument(ap, what: str = "request rows over data, KV heads over tensor") -> None:
    """The inference commands' shared --mesh flag (parse it with `parallel.sharding.parse_mesh`)."""
    ap.add_argument("--mesh", default=None, metavar="DATA,FSDP,TENSOR",
                    help=f"run on a device mesh, e.g. 1,1,8: weights laid out by the rules table, {what} "
                         "(default: one device)")


def add_kv_pages_argument(ap) -> None:
    """`--kv-pages NUM,SIZE`: the engine's paged KV cache (`Engine(kv_pages=...)`)."""
    ap.add_argument("--kv-pages", default=None, metavar="NUM,SIZE", type=parse_kv_pages,
                    help="paged KV cache: a pool of NUM pages of SIZE tokens shared by the slots, for the target "
                         "and the drafter (memory for the tokens in use; a request waits until the pool can hold "
                         "its prompt + max tokens). Default: dense caches of slots x max-len")


def add_prefill_chunk_argument(ap, default: int | None) -> None:
    """`--prefill-chunk N`: chunked prefill (`Engine(prefill_chunk=N)`); 0 = prompts prefilled whole."""
    ap.add_argument("--prefill-chunk", type=int, default=default, metavar="N",
                    help="a request joining while others decode has its prompt forwarded N tokens per round, packed "
                         "with the others' verification, instead of a prefill that stalls them; 0 = prefill whole "
                         f"prompts (default {default or 0})")


def prefill_chunk(value) -> int | None:
    """The CLI value as the Engine takes it (0 / None: whole prompts)."""
    if value is not None and value < 0:
        raise ValueError(f"--prefill-chunk {value}: give a number of tokens >= 1, or 0 to prefill prompts whole")
    return int(value) if value else None


def parse_kv_pages(text: str) -> tuple[int, int]:

    try:
        num, size = (int(x) for x in str(text).split(","))
        if num < 1 or size < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give NUM_PAGES,PAGE_SIZE (both >= 1), e.g. 512,16") from None
    return num, size


def parse_mesh_shape(text: str | None, devices: int) -> tuple[int, int, int]:
    """--mesh DATA,FSDP,TENSOR; None: 1,1,devices (tensor parallel over every device)."""
    text = text or f"1,1,{devices}"
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 3:
        raise ValueError(f"--mesh {text!r}: give DATA,FSDP,TENSOR, e.g. 1,1,8")
    return shape


def parse_stages(ap, text: str, known) -> tuple[str, ...]:
    """--stages a,b,...: the named stages in order, or `ap.error` naming the unknown ones."""
    stages = tuple(x for x in text.split(",") if x)
    bad = [x for x in stages if x not in known]
    if bad:
        ap.error(f"unknown stage(s) {', '.join(bad)}; choose from {', '.join(known)}")
    return stages
