"""`python -m dspark_jax bench tpu-predict`: docs/tpu_predictions.md, what DSpark will do on Cloud TPU
slices, from cost tables the TPU compiler predicts on this machine.

    python -m dspark_jax bench tpu-predict --out docs/tpu_predictions.md

Each entry is one `costs predict` run (a preset on a slice at R slots: the draft, a round per
verification bucket, the target-only step, the DFlash and MTP-1 drafts), in a process of its own,
kept as a cost table in `--cache` (docs/tpu_predictions_figures/, committed), so an interrupted run
resumes and `--render-only` rewrites the document from the tables. The document holds the
predictions beside the two published TPU measurements, the serving simulation of every method at
each concurrency (acceptance from published tau: calibration/profiles.py), and the overhead model
(one host overhead per round, fitted to one published point). Entries run in the order below:
the comparisons first, then the grid of targets x slices x concurrency.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

from dspark_jax.cli import report_user_errors

log = logging.getLogger(__name__)
BEGIN, END = "<!-- tpu_predictions:begin -->", "<!-- tpu_predictions:end -->"
ROOT = Path(__file__).resolve().parents[3]
GRID_TARGETS = ("qwen3_8b", "qwen3_4b", "qwen3_14b")
GRID_SLICES = ("v6e-8", "v5e-8", "v5p-8", "v7x-8")
GRID_SLOTS = (1, 8, 64, 256)
GRID_CONTEXT = 2048
# sglang-jax's published DSpark run: 1024-token prompts, 4096 output tokens, so a request holds
# 3072 tokens of KV on average over its decode; TP over the 8 devices of a v7x-8
SGLANG_SLOTS, SGLANG_CONTEXT = (1, 8, 32, 128), 3072
PAGED_SLOTS, PAGE_SIZE = (8, 64), 16


def entries() -> list[dict]:
    out = [dict(key=f"sglang-v7x-8-qwen3_8b_dspark-r{r}", preset="qwen3_8b_dspark", slice="v7x-8", slots=r,
                context=SGLANG_CONTEXT, kinds="dflash,mtp1") for r in SGLANG_SLOTS]
    # tpu-inference's DFlash on v5p-8 (4 chips), Qwen3-4B, K = 16 at batch 1; K = 128 for "K-flat"
    out += [dict(key="tpu-inference-v5p-8-qwen3_4b_dflash-k16", preset="qwen3_4b_dflash", slice="v5p-8", slots=1,
                 context=GRID_CONTEXT, block=16, kinds=""),
            dict(key="tpu-inference-v5p-8-qwen3_4b_dflash-k128", preset="qwen3_4b_dflash", slice="v5p-8", slots=1,
                 context=GRID_CONTEXT, block=128, kinds="", no_target_only=True)]
    # Qwen3-8B on every slice first, then the other targets on v6e-8, then the rest
    order = [(GRID_TARGETS[0], s) for s in GRID_SLICES] + [(t, GRID_SLICES[0]) for t in GRID_TARGETS[1:]]
    order += [(t, s) for t in GRID_TARGETS[1:] for s in GRID_SLICES[1:]]
    for target, slc in order:
        out += [dict(key=f"grid-{slc}-{target}_dspark-r{r}", preset=f"{target}_dspark", slice=slc, slots=r,
                     context=GRID_CONTEXT, kinds="dflash,mtp1") for r in GRID_SLOTS]
    # the paged cache (its Pallas kernel priced from its declared cost) beside the dense grid entries
    out += [dict(key=f"paged-v6e-8-qwen3_8b_dspark-r{r}", preset="qwen3_8b_dspark", slice="v6e-8", slots=r,
                 context=GRID_CONTEXT, kinds="", kv_pages=(r * GRID_CONTEXT // PAGE_SIZE, PAGE_SIZE))
            for r in PAGED_SLOTS]
    return out


def command(e: dict, cache: Path, programs: str = "") -> list[str]:
    cmd = [sys.executable, "-m", "dspark_jax", "costs", "predict", str(ROOT / "configs" / f"{e['preset']}.yaml"),
           "--topology", e["slice"], "--slots", str(e["slots"]), "--context", str(e["context"]),
           "--out", str(cache / f"{e['key']}.json")]
    if e.get("block"):
        cmd += ["--block", str(e["block"])]
    if e.get("kinds"):
        cmd += ["--draft-kinds", e["kinds"]]
    if e.get("no_target_only"):
        cmd += ["--no-target-only"]
    if e.get("kv_pages"):
        cmd += ["--kv-pages", ",".join(map(str, e["kv_pages"]))]
    if programs:
        cmd += ["--programs", programs]
    return cmd


def _needs(e: dict, cache: Path, programs: str) -> bool:
    """Whether `--programs` still has work on the entry's kept table: a named program it lacks,
    round@R that is not yet the one-column view, or skip@R compiled from another program than the
    engine's round without a draft (other named programs are compiled again)."""
    from dspark_jax.scheduler.costs import SKIPPED_ROUND

    path = cache / f"{e['key']}.json"
    if not path.exists():
        return False
    kept = json.loads(path.read_text())["programs"]
    for name in (n for n in programs.split(",") if n):
        prog = kept.get(name.replace("@R", f"@{e['slots']}") if name in ("round@R", "skip@R") else name)
        if prog is None or (name == "round@R" and prog.get("view_width") != 1) or name not in ("round@R", "skip@R"):
            return True
        if name == "skip@R" and prog.get("program") != SKIPPED_ROUND:
            return True
    return False


def run_entry(e: dict, cache: Path, timeout: int, programs: str = "") -> bool:
    t0 = time.perf_counter()
    try:
        res = subprocess.run(command(e, cache, programs), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.error("%s: no result within %d s", e["key"], timeout)
        return False
    if res.returncode or not (cache / f"{e['key']}.json").exists():
        err = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.startswith("error")][-1:]
        (cache / f"{e['key']}.failed").write_text("\n".join(err) or res.stderr[-2000:])
        log.error("%s failed (%.0f s): %s", e["key"], time.perf_counter() - t0, " | ".join(err))
        return False
    return True


def _reprice(cache: Path) -> None:
    from dspark_jax.engine.predict import reprice
    from dspark_jax.parallel.topology import slice_devices
    from dspark_jax.parallel.tpu_cost import chip_clock_hz

    for path in sorted(cache.glob("*.json")):
        d = json.loads(path.read_text())
        clock = chip_clock_hz(slice_devices(d["topology"])[0])
        path.write_text(json.dumps(reprice(d, clock), indent=1))
        log.info("%s: %.3f GHz", path.stem, clock / 1e9)


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench tpu-predict", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "tpu_predictions.md")
    ap.add_argument("--cache", type=Path, default=ROOT / "docs" / "tpu_predictions_figures",
                    help="one predicted cost table per entry (kept in the repository, so a later run resumes)")
    ap.add_argument("--only", default="", help="compile only entries whose key contains this text")
    ap.add_argument("--redo", action="store_true", help="predict again entries already in the cache")
    ap.add_argument("--render-only", action="store_true", help="write the document from the cache, compile nothing")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per entry")
    ap.add_argument("--rounds", type=int, default=300, help="simulated rounds per method and concurrency")
    ap.add_argument("--programs", default="", metavar="NAMES",
                    help="recompile only these programs of the kept tables (`costs predict --programs`), e.g. "
                         "round@R,skip@R; tables that already hold them (round@R on the one-column view) are "
                         "left as they are")
    ap.add_argument("--reprice", action="store_true",
                    help="re-derive the kept tables' times from their cycles with the current clock calibration "
                         "(parallel/tpu_cost.py), compiling nothing else")
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.reprice:
        _reprice(args.cache)
    elif not args.render_only:
        from dspark_jax.parallel.topology import require_libtpu

        require_libtpu()
        if args.programs:
            todo = [e for e in entries() if args.only in e["key"] and _needs(e, args.cache, args.programs)]
        else:
            todo = [e for e in entries() if args.only in e["key"]
                    and (args.redo or not (args.cache / f"{e['key']}.json").exists())]
        for i, e in enumerate(todo, 1):
            t0 = time.perf_counter()
            ok = run_entry(e, args.cache, args.timeout, args.programs)
            log.info("[%d/%d] %s %s in %.0f s", i, len(todo), e["key"], "done" if ok else "FAILED",
                     time.perf_counter() - t0)
    from dspark_jax.bench.tpu_report import write_report

    write_report(args.out, args.cache, entries(), rounds=args.rounds)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
