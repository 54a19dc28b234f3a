"""Per-chip peak memory of the programs a notebook runs, on Cloud TPU chips, computed on any machine:
the drafter's train step and the engine's decoding round (and prefill), compiled by the TPU
compiler (libtpu; no TPU needed: parallel/topology.py) for each named slice, and a text table of
them beside each chip's HBM. A program that cannot fit is refused by the compiler: the row says so
instead of raising."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import sys
import tempfile
import time

from dspark_jax.engine.plan import peak_bytes, plan
from dspark_jax.parallel.slices import parse_slice
from dspark_jax.parallel.topology import require_libtpu, slice_mesh
from dspark_jax.train.compiled import compile_steps, peak

__all__ = ["COLAB_CHIPS", "chip_memory", "format_memory_table", "tpu_compiler_available"]

# Colab's TPU runtimes: one v5e chip (16 GiB HBM) or one v6e chip (32 GiB HBM)
COLAB_CHIPS = ("v5e-1", "v6e-1")
GIB, MIB = 1024 ** 3, 1024 ** 2


def tpu_compiler_available() -> bool:
    """libtpu (the TPU compiler) is importable: `pip install -e ".[aot]"` (or ".[tpu]") installs it."""
    return importlib.util.find_spec("libtpu") is not None


@contextlib.contextmanager
def _quiet_fd2():
    """libtpu's C++ start-up logs ("could not determine TPU accelerator type", ...) go to file
    descriptor 2, below Python's sys.stderr: hold them in a file, shown only if the block fails."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real fd 2 (some embedded interpreters)
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved, 2)
            held.seek(0)
            text = held.read().decode(errors="replace").strip()
            if text:
                print(text[-4000:], file=sys.stderr)
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _mesh3(mesh) -> tuple[int, int, int]:
    if mesh is None:
        return (1, 1, 1)
    if isinstance(mesh, str):
        return tuple(int(x) for x in mesh.split(","))  # "1,1,8"
    if isinstance(mesh, dict):
        return (int(mesh.get("data", -1)), int(mesh.get("fsdp", 1)), int(mesh.get("tensor", 1)))
    if hasattr(mesh, "fsdp"):  # a MeshSection
        return (mesh.data, mesh.fsdp, mesh.tensor)
    return tuple(int(x) for x in mesh)


def chip_memory(cfg, chips=COLAB_CHIPS, *, slots: int, context: int, train_mesh=None, serve_mesh=None,
                programs=("train", "round")) -> list[dict]:
    """One row per slice in `chips`: {"chip", "devices", "hbm_gib", "train", "round", (with "prefill" in
    `programs`) "prefill", "compile_s"}: per-device peak bytes of the drafter's train step at the
    config's shapes (batch, seq_len, anchors) on `train_mesh` (default: the config's mesh, data filling
    the slice) and of the engine's round for `slots` x `context` tokens on `serve_mesh` (default
    1,1,1: one chip), compiled by XLA:TPU for that slice. `cfg.target.model` must be set
    (`with_checkpoint_model`). Needs libtpu (`tpu_compiler_available`)."""

    if cfg.target.model is None:
        raise ValueError("cfg.target.model is not set: the programs compile from shapes; fill it from the "
                         "checkpoint with with_checkpoint_model(cfg)")
    require_libtpu()
    tm = _mesh3(train_mesh if train_mesh is not None else cfg.mesh)
    sm = _mesh3(serve_mesh)
    rows = []
    for chip in chips:
        slc = parse_slice(chip)
        t0 = time.perf_counter()
        row = {"chip": slc.name, "hbm_gib": slc.hbm_gib}
        with _quiet_fd2():
            mesh = slice_mesh(slc, *tm)
            row["devices"] = int(mesh.devices.size)
            if "train" in programs:
                with _refused(row, "train"):
                    row["train"] = int(peak(compile_steps(cfg, steps=("train",), mesh=mesh)["train"]))
            for p in (p for p in programs if p in ("round", "prefill")):
                with _refused(row, p):
                    res = plan(cfg, slots, context, sm, compile_round=True, topology=slc.name, programs=(p,))
                    row[p] = int(peak_bytes(res["programs"][p]))
        row["compile_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    return rows


_HBM_NEED = re.compile(r"\(([\d.]+ ?[KMGT]i?B?)\) exceeds available HBM \(([\d.]+ ?[KMGT]i?B?)\)")


@contextlib.contextmanager
def _refused(row: dict, program: str):
    """XLA:TPU refuses to compile a program that cannot fit the chip's HBM: recorded in the row
    (`row[program] = None`, `row[program + "_refused"]` = the compiler's reason), not raised."""
    try:
        yield
    except (ValueError, RuntimeError) as e:
        text = str(e)
        if "HBM" not in text or not any(w in text for w in ("Ran out of memory", "RESOURCE_EXHAUSTED", "does not fit")):
            raise
        m = _HBM_NEED.search(text)
        row[program] = None
        row[program + "_refused"] = (f"needs {m.group(1)}, {m.group(2)} of HBM available" if m
                                     else next((ln.strip() for ln in text.splitlines() if "HBM" in ln), text)[:200])


def _size(b: int) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB else f"{b / MIB:.1f} MiB"


PROGRAM_NAMES = {"train": "drafter train step", "round": "engine round", "prefill": "engine prefill"}


def format_memory_table(rows: list[dict], cfg=None, *, slots: int | None = None, context: int | None = None) -> str:
    """A text table: one line per program, one column per chip (its peak per chip, and whether it
    fits), then each chip's HBM. With `cfg` / `slots` / `context`, the shapes are named."""
    programs = [p for p in ("train", "round", "prefill") if any(p in r for r in rows)]
    label = dict(PROGRAM_NAMES)
    if cfg is not None:
        label["train"] += f" ({cfg.train.batch_size} x {cfg.data.seq_len} tokens)"
    if slots and context:
        label["round"] += f" ({slots} slots x {context})"
        label["prefill"] += f" ({slots} slots)"
    w = max(len(label[p]) for p in programs + ["train"])
    cols = [f"{r['chip']} peak" for r in rows]
    cw = max([16] + [len(c) for c in cols])
    lines = [f"{'program':<{w}}  " + "  ".join(f"{c:>{cw}}" for c in cols)]
    for p in programs:
        cells = []
        for r in rows:
            b = r.get(p)
            if p + "_refused" in r:
                cells.append("does not fit (!)")
            else:
                cells.append("-" if b is None else f"{_size(b)}{'' if b <= r['hbm_gib'] * GIB else ' (!)'}")
        lines.append(f"{label[p]:<{w}}  " + "  ".join(f"{c:>{cw}}" for c in cells))
    lines.append(f"{'chip HBM':<{w}}  " + "  ".join(f"{r['hbm_gib']:>{cw - 4}g} GiB" for r in rows))
    refused = [(r["chip"], p, r[p + "_refused"]) for r in rows for p in programs if p + "_refused" in r]
    for chip, p, why in refused:
        lines.append(f"(!) {chip}: the TPU compiler refused the {PROGRAM_NAMES[p]}: {why}")
    if refused and "train" in {p for _, p, _ in refused}:
        lines.append("    for the train step: raise train.grad_accum, lower train.batch_size or data.seq_len, "
                     "or set train.remat=drafter_layers")
    if any((r.get(p) or 0) > r["hbm_gib"] * GIB for r in rows for p in programs):
        lines.append("(!) more than the chip's HBM: it would not fit")
    if rows and all("compile_s" in r for r in rows):
        lines.append("compiled by XLA:TPU on this machine (no TPU used) in "
                     + ", ".join(f"{r['compile_s']:.0f} s ({r['chip']})" for r in rows))
    return "\n".join(lines)
