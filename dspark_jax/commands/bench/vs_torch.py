"""`python -m dspark_jax bench vs-torch`: our hot paths beside transformers and beside an older commit of ours.

    python -m dspark_jax bench vs-torch [--baseline-ref REF|none] [--rounds 5] [--repeats 5] [--json OUT]

Three worker processes (dspark_jax/commands/bench/vs_torch_worker.py) build the `bench_cpu` preset's shapes
(target vocab 8192, hidden 256, 8 layers, 8/4 heads, head_dim 32, MLP 768; DSpark drafter 2
layers, Markov rank 64, gamma 7; sequence 512, 64 anchors, batch 1) and compile: transformers'
Qwen3ForCausalLM (torch), this checkout, and this repository at `--baseline-ref` (extracted with
`git archive`). Then, for `--rounds` rounds, every region is timed `--repeats` times in each worker
in turn; only one worker runs at a time, so they do not compete for the cores, and a ratio is
taken within a round (adjacent in time) before the median and range over rounds is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np

# The commit before the speed work against the PyTorch stack (docs/benchmarks.md): the baseline it is timed against.
DEFAULT_BASELINE = "a6caf08"
WORKER = Path(__file__).with_name("vs_torch_worker.py")


class Worker:
    """A worker process answering timing requests over pipes."""

    def __init__(self, name: str, side: str, pythonpath: str | None):
        env = dict(os.environ)
        if pythonpath is not None:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(WORKER), side], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)
        hello = self._read()
        self.regions, self.origin = hello["regions"], hello["origin"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the {self.name} worker stopped (its error is printed above)")
        return json.loads(line)

    def time(self, region: str, reps: int) -> list[float]:
        self.proc.stdin.write(json.dumps({"region": region, "reps": reps}) + "\n")
        self.proc.stdin.flush()
        return self._read()["times"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


def extract_ref(ref: str, dest: Path) -> Path:
    """This repository's `dspark_jax/` and `configs/` at `ref`, written under `dest`."""
    repo = Path(__file__).resolve().parents[3]
    if not (repo / ".git").exists():
        raise SystemExit(f"--baseline-ref needs a git checkout of dspark_jax ({repo} is not one); "
                         "pass --baseline-ref none to compare with transformers only")
    archive = dest / "ref.tar"
    try:
        subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", "-o", str(archive),
                        ref, "dspark_jax", "configs"],
                       check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"cannot read commit {ref!r} in {repo}: {e.stderr.strip()} "
                         "(fetch the full history, or pass another --baseline-ref)") from None
    tree = dest / "tree"
    with tarfile.open(archive) as tar:
        tar.extractall(tree, filter="data")
    return tree


def _fmt(seconds: float) -> str:
    return f"{1e3 * seconds:8.2f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax bench vs-torch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-ref", default=DEFAULT_BASELINE,
                    help=f"git commit of this repository to time beside the checkout (default {DEFAULT_BASELINE}, "
                         "where the speed work started); 'none' to skip")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    ap.add_argument("--repeats", dest="reps", type=int, default=5,
                    help="timed calls per region per worker per round (default 5)")
    ap.add_argument("--no-torch", action="store_true", help="skip the transformers worker")
    ap.add_argument("--json", default=None, help="also write every timing to this JSON file")
    args = ap.parse_args(argv)

    repo = str(Path(__file__).resolve().parents[3])
    workers = []
    with tempfile.TemporaryDirectory(prefix="vs_torch_") as tmp:
        print("compiling in the workers (about a minute each) ...", flush=True)
        if not args.no_torch:
            workers.append(Worker("transformers", "torch", None))
        if args.baseline_ref.lower() != "none":
            workers.append(Worker(f"ours@{args.baseline_ref}", "jax", str(extract_ref(args.baseline_ref, Path(tmp)))))
        workers.append(Worker("ours", "jax", repo))
        try:
            regions = list(dict.fromkeys(r for w in workers for r in w.regions))
            per_round = {(w.name, r): [] for w in workers for r in w.regions}
            for i in range(args.rounds):
                for r in regions:
                    for w in workers:
                        if r in w.regions:
                            per_round[(w.name, r)].append(float(np.median(w.time(r, args.reps))))
                print(f"round {i + 1}/{args.rounds} done", flush=True)
        finally:
            for w in workers:
                w.close()

    ours, others = workers[-1].name, [w.name for w in workers[:-1]]
    print(f"\nmedian ms over {args.rounds} rounds (each the median of {args.reps} calls); ratios ours / other "
          f"taken within a round: median [min, max]")
    head = (f"{'region':<26}" + "".join(f"{w.name:>20}" for w in workers)
            + "".join(f"{'ours / ' + o:>30}" for o in others))
    print(head)
    for r in regions:
        row = f"{r:<26}"
        for w in workers:
            ts = per_round.get((w.name, r))
            row += f"{_fmt(np.median(ts)) if ts else '-':>20}"
        for o in others:
            if per_round.get((o, r)):
                ratio = np.asarray(per_round[(ours, r)]) / np.asarray(per_round[(o, r)])
                row += f"{np.median(ratio):>14.2f} [{ratio.min():.2f}, {ratio.max():.2f}]"
            else:
                row += f"{'-':>30}"
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": args.rounds, "reps": args.reps,
                                               "times": {f"{w}|{r}": v for (w, r), v in per_round.items()},
                                               "origins": {w.name: w.origin for w in workers}}, indent=1))
    return 0
