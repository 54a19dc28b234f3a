"""What the notebooks show about Cloud TPU chips, computed on any machine, and their plain output.

* `chip_memory(cfg, chips, slots=, context=)`: per-chip peak memory of the programs a notebook
  runs, the drafter's train step and the engine's decoding round, compiled by the TPU compiler for
  each named slice (libtpu; no TPU needed: `parallel/topology.py`). `COLAB_CHIPS` are Colab's TPU
  runtimes, one chip each. `format_memory_table(rows)` prints them next to each chip's HBM.
* `with_checkpoint_model(cfg, path)`: fills `target.model` (and the drafter's mask token) from a
  checkpoint's `config.json` / tokenizer, which compiling without weights needs.
* `acceptance_by_position(traces, gamma)`: conditional acceptance per draft position pooled over
  requests, with a 95 % bootstrap interval over requests (rounds of one request are not independent).
* `plain_output()`: while a long call runs, its printed lines pass through with machine paths
  made relative (`scrub_paths`) and progress bars dropped, so stored notebook outputs carry neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import logging
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from dspark_jax.config.loader import ConfigError
from dspark_jax.engine.plan import peak_bytes, plan
from dspark_jax.io.hf import read_config
from dspark_jax.parallel.slices import parse_slice
from dspark_jax.parallel.topology import require_libtpu, slice_mesh
from dspark_jax.text.tokenizer import Tokenizer
from dspark_jax.train.compiled import compile_steps, peak

__all__ = [
    "COLAB_CHIPS",
    "acceptance_by_position",
    "chip_memory",
    "format_memory_table",
    "is_progress_bar",
    "plain_output",
    "scrub_paths",
    "tpu_compiler_available",
    "with_checkpoint_model",
]

# Colab's TPU runtimes: one v5e chip (16 GiB HBM) or one v6e chip (32 GiB HBM)
COLAB_CHIPS = ("v5e-1", "v6e-1")
GIB, MIB = 1024 ** 3, 1024 ** 2


def tpu_compiler_available() -> bool:
    """libtpu (the TPU compiler) is importable: `pip install -e ".[aot]"` (or ".[tpu]") installs it."""
    return importlib.util.find_spec("libtpu") is not None


# ---------------------------------------------------------------------------- configs


def with_checkpoint_model(cfg, path=None, *, fallback_mask_token_id: int | None = None):
    """`cfg` with `target.model` read from the checkpoint's config.json (`path`, default
    `cfg.target.path`) and `drafter.mask_token_id`, when unset, from its tokenizer's <|mask|> token,
    else `fallback_mask_token_id` (Qwen3's tokenizer has none: the reference uses the unused
    embedding row 151669)."""

    path = Path(path or cfg.target.path)
    _, model = read_config(path)
    target = dataclasses.replace(cfg.target, model=model)
    drafter = cfg.drafter
    if drafter.mask_token_id is None:
        mask = None
        if (path / "tokenizer.json").is_file():
            mask = Tokenizer.load(path).mask_id
        if mask is None:
            mask = fallback_mask_token_id
        if mask is None:
            raise ConfigError("drafter.mask_token_id is not set and the tokenizer has no <|mask|> token: "
                              "set drafter.mask_token_id to an unused embedding row (Qwen3: 151669)")
        drafter = dataclasses.replace(drafter, mask_token_id=mask)
    return dataclasses.replace(cfg, target=target, drafter=drafter)


# ---------------------------------------------------------------------------- TPU memory


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


# ---------------------------------------------------------------------------- acceptance


def acceptance_by_position(traces: dict, gamma: int, *, n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """Conditional acceptance per draft position k = 1..gamma pooled over every round of every
    request (`Traces.arrays()`: "request", "accepted", "length"), and its `level` bootstrap interval
    over requests. Keys: "position", "rate", "lo", "hi" (nan where no round reached k), "rounds"
    (rounds that reached k: the denominators), "requests". Rounds cut short by a stop token or the
    token budget ("cut") are left out, as in `eval.evaluate`."""
    req, acc, length = (np.asarray(traces[k]) for k in ("request", "accepted", "length"))
    if "cut" in traces:  # rounds cut by a stop token or max_new discarded drafts: not rejections
        keep = ~np.asarray(traces["cut"], bool)
        req, acc, length = req[keep], acc[keep], length[keep]
    ids, inv = np.unique(req, return_inverse=True)
    ks = np.arange(1, gamma + 1)
    num = np.zeros((len(ids), gamma))
    den = np.zeros((len(ids), gamma))
    np.add.at(num, inv, (acc[:, None] >= ks).astype(float))
    np.add.at(den, inv, ((acc[:, None] >= ks - 1) & (length[:, None] >= ks)).astype(float))
    tot_n, tot_d = num.sum(0), den.sum(0)
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(tot_d > 0, tot_n / np.maximum(tot_d, 1), np.nan)
        lo = hi = np.full(gamma, np.nan)
        if len(ids) > 1:
            rng = np.random.default_rng(seed)
            w = rng.multinomial(len(ids), np.full(len(ids), 1 / len(ids)), size=n_boot).astype(float)
            bn, bd = w @ num, w @ den
            boot = np.where(bd > 0, bn / np.maximum(bd, 1), np.nan)
            q = (1 - level) / 2
            ok = ~np.isnan(boot).all(0)
            lo, hi = np.full(gamma, np.nan), np.full(gamma, np.nan)
            if ok.any():
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    lo[ok] = np.nanquantile(boot[:, ok], q, axis=0)
                    hi[ok] = np.nanquantile(boot[:, ok], 1 - q, axis=0)
    return {"position": ks.tolist(), "rate": rate.tolist(), "lo": lo.tolist(), "hi": hi.tolist(),
            "rounds": tot_d.astype(int).tolist(), "requests": len(ids)}


# ---------------------------------------------------------------------------- plain output

_BAR = re.compile(r"\d+%\|.*\|\s*\d+/\d+|\d+/\d+ \[\d+:\d+(?:<|,)|\|[\u2588-\u258f ]{3,}\|")


def is_progress_bar(line: str) -> bool:
    """A tqdm bar ("train:  40%|####      | 4/10 [00:02<00:03, 2.0step/s]") or any
    carriage-return refresh."""
    return "\r" in line or bool(_BAR.search(line))


def _roots() -> list[tuple[str, str]]:
    out = []
    for root, name in ((Path.cwd(), ""), (Path.home(), "~"), (Path(sys.prefix), "<python>"),
                       (Path(tempfile.gettempdir()), "<tmp>")):
        for r in {str(root), str(root.resolve())}:
            if len(r) > 1:
                out.append((r, name))
    return sorted(out, key=lambda x: -len(x[0]))  # the longest (most specific) first


def scrub_paths(text) -> str:
    """Machine paths made portable: the working directory's prefix removed (relative paths), the
    home directory as ~, the Python installation as <python>, the temp directory as <tmp>."""
    text = str(text)
    for root, name in _roots():
        if name == "":
            text = re.sub(re.escape(root) + r"(?:/|(?=[\s'\"`,)\]]|$))", "", text)
        else:
            text = text.replace(root, name)
    return text


class _Lines(io.TextIOBase):
    """A write-through stream: complete lines go to `out` scrubbed, progress-bar refreshes are dropped."""
    def __init__(self, out):
        self.out, self.buf = out, ""

    def writable(self) -> bool:
        return True

    def write(self, s) -> int:
        self.buf += s
        *lines, self.buf = self.buf.split("\n")
        for line in lines:
            self._emit(line)
        return len(s)

    def _emit(self, line: str) -> None:
        shown = line.rsplit("\r", 1)[-1]  # what a terminal shows after the refreshes
        if "\r" in line or is_progress_bar(shown):
            return
        self.out.write(scrub_paths(shown) + "\n")

    def flush(self) -> None:
        self.out.flush()

    def close_buffer(self) -> None:
        if self.buf:
            self._emit(self.buf)
            self.buf = ""
        self.out.flush()


@contextlib.contextmanager
def plain_output():
    """Inside: printed lines (stdout and stderr) pass through with machine paths scrubbed and
    progress bars (anything refreshed with a carriage return) dropped; tqdm's "IProgress not
    found" notebook warning and tensorboardX's NaN warnings (a held-out interval from one batch)
    are not shown. Pair with `run(cfg, progress=False)`; the run's summary table gives one line
    per phase."""
    out, err = _Lines(sys.stdout), _Lines(sys.stderr)
    tb = logging.getLogger("tensorboardX.x2num")
    level = tb.level
    tb.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            warnings.filterwarnings("ignore", message=".*IProgress not found.*")
            yield
    finally:
        tb.setLevel(level)
        out.close_buffer()
        err.close_buffer()
