"""`python -m dspark_jax bench tpu-memory`: docs/tpu_memory.md's tables, from the TPU compiler.

    python -m dspark_jax bench tpu-memory --out docs/tpu_memory.md

Every Qwen3 preset's train and eval steps compiled for the slice it names, and the serving
engine's round and prefill (dense and paged KV) of each Qwen3 target on v5e-8 / v6e-8 / v5p-8 /
v7x-8, each by libtpu on this machine (no TPU; parallel/topology.py). Each compile runs in a
process of its own (the large ones hold several GiB while compiling) and its figures are kept in
`--cache` as JSON (docs/tpu_memory_figures/, committed), so an interrupted run resumes where it
stopped, on this machine or another, and `--only` refreshes a subset.
The tables are written between the markers in `--out`; the rest of the file is left as it is.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

from dspark_jax.cli import report_user_errors

log = logging.getLogger(__name__)
GIB = 1024 ** 3
BEGIN, END = "<!-- tpu_memory:begin -->", "<!-- tpu_memory:end -->"
SERVE_SLICES = ("v5e-8", "v6e-8", "v5p-8", "v7x-8")
SERVE_TARGETS = ("qwen3_4b_dspark", "qwen3_8b_dspark", "qwen3_14b_dspark")
SERVE_SLOTS, SERVE_CONTEXT, SERVE_PAGE = 32, 4096, 16
# the paged pool holds half of what dense caches reserve (slots averaging half the context)
SERVE_PAGES = SERVE_SLOTS * SERVE_CONTEXT // 2 // SERVE_PAGE


def train_presets(configs: Path) -> list[str]:
    return sorted(p.stem for p in configs.glob("qwen3_*.yaml"))


def entries(configs: Path, what: str) -> list[dict]:
    out = []
    if what in ("all", "train"):
        out += [{"kind": "train", "preset": p, "key": f"train-{p}"} for p in train_presets(configs)]
    if what in ("all", "serve"):
        for target in SERVE_TARGETS:
            for slc in SERVE_SLICES:
                for paged in (False, True):
                    key = f"serve-{target}-{slc}-{'paged' if paged else 'dense'}"
                    out.append({"kind": "serve", "preset": target, "slice": slc, "paged": paged, "key": key})
    return out


def _train_worker(preset: str, configs: Path) -> dict:
    from dspark_jax.config import from_cli
    from dspark_jax.parallel.slices import parse_slice
    from dspark_jax.parallel.topology import slice_mesh
    from dspark_jax.train.compiled import compile_steps, peak

    cfg = from_cli([str(configs / f"{preset}.yaml")])
    name = cfg.mesh.slice
    if not name:
        raise ValueError(f"{preset} names no mesh.slice")
    slc = parse_slice(name)
    mesh = slice_mesh(slc, cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
    mem = compile_steps(cfg, mesh=mesh)
    devices = int(mesh.devices.size)
    return {"slice": slc.name, "chips": slc.chips, "devices": devices,
            "mesh": [cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor], "remat": cfg.train.remat,
            "hbm_gib": slc.hbm_gib * slc.chips / devices,
            "compile_s": round(sum(m["compile_seconds"] for m in mem.values()), 1),
            "train": peak(mem["train"]), "eval": peak(mem["eval"]), "kernels": mem["train"]["kernels"], "raw": mem}


def _serve_worker(preset: str, slc_name: str, paged: bool, configs: Path) -> dict:
    from dspark_jax.config import from_cli
    from dspark_jax.engine.plan import device_hbm_gib, peak_bytes, plan
    from dspark_jax.parallel.slices import parse_slice
    from dspark_jax.parallel.topology import slice_devices

    cfg = from_cli([str(configs / f"{preset}.yaml")])
    n = len(slice_devices(parse_slice(slc_name)))
    res = plan(cfg, SERVE_SLOTS, SERVE_CONTEXT, (1, 1, n), compile_round=True, topology=slc_name,
               kv_pages=(SERVE_PAGES, SERVE_PAGE) if paged else None, programs=("round", "prefill"))
    state = res["target_weights"] + res["drafter_weights"] + res["target_kv"] + res["drafter_kv"]
    progs = res["programs"]
    # a program the TPU compiler refused for lack of HBM keeps the compiler's reason instead of a peak
    fig = lambda p: progs[p].get("out_of_memory") or peak_bytes(progs[p])
    return {"slice": slc_name, "devices": n, "hbm_gib": device_hbm_gib(slc_name), "state": state,
            "round": fig("round"), "prefill": fig("prefill"),
            "compile_s": sum(p["compile_s"] for p in progs.values()), "kernels": progs["round"].get("kernels"),
            "paged_attention": res["paged_attention"]}


def run_entry(entry: dict, configs: Path, cache: Path, timeout: int) -> dict | None:
    """Compile one entry in a child process -> its figures (cached), or None with the error logged."""
    path = cache / f"{entry['key']}.json"
    cmd = [sys.executable, "-m", "dspark_jax", "bench", "tpu-memory", "--worker", json.dumps(entry),
           "--configs", str(configs), "--cache", str(cache)]
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log.error("%s: no result within %d s", entry["key"], timeout)
        return None
    if res.returncode or not path.exists():
        tail = [ln for ln in res.stderr.splitlines() if ln.strip() and not ln.startswith(("W", "I0", "E0000"))][-3:]
        log.error("%s failed (%.0f s): %s", entry["key"], time.perf_counter() - t0, " | ".join(tail))
        return None
    return json.loads(path.read_text())


def _gib(b) -> str:
    """Bytes as GiB; text (the compiler's refusal) as 'does not fit' with the figure it gave."""
    if isinstance(b, str):
        m = re.search(r"\(([\d.]+G)\) exceeds available HBM \(([\d.]+G)\)", b)
        return f"does not fit ({m.group(1)} > {m.group(2)})" if m else "does not fit"
    return f"{b / GIB:.2f} GiB"


def render(configs: Path, cache: Path) -> str:
    """The markdown tables from the cached figures (missing entries say how to compile them)."""
    cpu_path = Path(__file__).resolve().parents[3] / "docs" / "tpu_memory_xla_cpu.json"
    cpu = json.loads(cpu_path.read_text()) if cpu_path.exists() else {}
    load = lambda key: json.loads((cache / f"{key}.json").read_text()) if (cache / f"{key}.json").exists() else None
    lines = ["Train and eval steps, per chip, compiled for the slice each preset names (XLA:CPU on fake devices "
             "beside them, where recorded):", "",
             "| preset | slice (chips) | mesh d x f x t | remat | train peak | eval peak | HBM per device | margin "
             "| XLA:CPU train / eval | compile |", "|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries(configs, "train"):
        r, c = load(e["key"]), cpu.get(e["preset"])
        cpu_txt = f"{c['train']:.2f} / {c['eval']:.2f} GiB" if c else "-"
        if r is None:
            lines.append(f"| {e['preset']} | not compiled yet | | | | | | | {cpu_txt} | |")
            continue
        margin = r["hbm_gib"] - max(r["train"], r["eval"]) / GIB
        lines.append(f"| {e['preset']} | {r['slice']} ({r['chips']}) | {' x '.join(map(str, r['mesh']))} | "
                     f"{r['remat'] or 'none'} | {_gib(r['train'])} | {_gib(r['eval'])} | {r['hbm_gib']:g} GiB | "
                     f"{margin:.2f} GiB | {cpu_txt} | {r['compile_s'] / 60:.1f} min |")
    lines += ["", f"Serving, per chip: {SERVE_SLOTS} slots x {SERVE_CONTEXT} tokens, tensor parallel over the slice's "
              f"devices, DSpark drafter at its block size; paged: a pool of {SERVE_PAGES} pages of {SERVE_PAGE} "
              "tokens (half the dense caches' tokens) read by the Pallas kernel. The prefill is the largest "
              "prompt bucket for every slot at once (the engine prefills whole prompts on an idle engine); "
              "'(over)': a peak above the device's HBM; 'does not fit': XLA:TPU refused to compile it, "
              "with the temporaries it needed and the HBM it had.", "",
              "| target | slice | KV | state | round peak | prefill peak | HBM per device "
              "| Mosaic kernels in the round "
              "| compile |", "|---|---|---|---|---|---|---|---|---|"]
    for e in entries(configs, "serve"):
        r = load(e["key"])
        kv = "paged" if e["paged"] else "dense"
        if r is None:
            lines.append(f"| {e['preset']} | {e['slice']} | {kv} | not compiled yet | | | | | |")
            continue
        over = lambda b: _gib(b) + (" (over)" if not isinstance(b, str) and b > r["hbm_gib"] * GIB else "")
        lines.append(f"| {e['preset']} | {e['slice']} | {kv} | {_gib(r['state'])} | {over(r['round'])} | "
                     f"{over(r['prefill'])} | {r['hbm_gib']:g} GiB | "
                     f"{r['kernels'] if r['kernels'] is not None else '-'} | "
                     f"{r['compile_s']:.0f} s |")
    return "\n".join(lines)


def write_doc(out: Path, table: str) -> None:
    text = out.read_text() if out.exists() else ""
    block = f"{BEGIN}\n{table}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text + "\n" + block + "\n"
    out.write_text(text)


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench tpu-memory", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    root = Path(__file__).resolve().parents[3]
    ap.add_argument("--out", type=Path, default=root / "docs" / "tpu_memory.md")
    ap.add_argument("--configs", type=Path, default=root / "configs")
    ap.add_argument("--cache", type=Path, default=root / "docs" / "tpu_memory_figures",
                    help="one JSON of figures per compile (kept in the repository, so a later run resumes)")
    ap.add_argument("--what", choices=("all", "train", "serve"), default="all")
    ap.add_argument("--only", default="", help="compile only entries whose key contains this text")
    ap.add_argument("--redo", action="store_true", help="compile again entries already in the cache")
    ap.add_argument("--render-only", action="store_true", help="write the tables from the cache, compile nothing")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per compile")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)
    if args.worker:
        e = json.loads(args.worker)
        res = (_train_worker(e["preset"], args.configs) if e["kind"] == "train"
               else _serve_worker(e["preset"], e["slice"], e["paged"], args.configs))
        (args.cache / f"{e['key']}.json").write_text(json.dumps(res, indent=1))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not args.render_only:
        from dspark_jax.parallel.topology import require_libtpu

        require_libtpu()
        todo = [e for e in entries(args.configs, args.what) if args.only in e["key"]
                and (args.redo or not (args.cache / f"{e['key']}.json").exists())]
        for i, e in enumerate(todo, 1):
            t0 = time.perf_counter()
            ok = run_entry(e, args.configs, args.cache, args.timeout)
            log.info("[%d/%d] %s %s in %.0f s", i, len(todo), e["key"], "done" if ok else "FAILED",
                     time.perf_counter() - t0)
    write_doc(args.out, render(args.configs, args.cache))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
