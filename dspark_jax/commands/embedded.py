"""`python -m dspark_jax embedded build|path|verify|report`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from dspark_jax.cli import report_user_errors
from dspark_jax.io.cache import CACHE_ENV, cache_root

PRESET_NAMES = ("full", "tiny")  # embedded.target.PRESETS, named here so that --help needs no jax


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax embedded",
                                 description="Build, locate, verify or evaluate the embedded default target.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, hlp in (("build", "build the target into the cache (no-op if a valid one exists)"),
                      ("path", "print the cached target directory (building it if needed)"),
                      ("verify", "check the cached target against its manifest"),
                      ("report", "held-out loss per domain vs a Kneser-Ney-lite bigram")):
        sp = sub.add_parser(name, help=hlp)
        sp.add_argument("--preset", default="full", choices=PRESET_NAMES)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--cache-dir", default=None, help=f"default ${CACHE_ENV} or ~/.cache/dspark_jax")
        if name == "build":
            sp.add_argument("--force", action="store_true", help="rebuild even if a valid target is cached")
        sp.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    from dspark_jax.embedded.report import format_report, heldout_report
    from dspark_jax.embedded.target import embedded_target_dir, target_cache_dir, verify_target_dir

    prog = not a.no_progress
    root = Path(a.cache_dir) if a.cache_dir else cache_root()
    d = target_cache_dir(a.preset, a.seed, root)
    if a.cmd == "verify":
        problem = verify_target_dir(d)
        print(f"{d}: {'ok' if problem is None else problem}")
        return 0 if problem is None else 1
    t0 = time.time()
    d = embedded_target_dir(build=True, progress=prog, preset=a.preset, seed=a.seed,
                            force=getattr(a, "force", False), cache_dir=root)
    if a.cmd == "build":
        print(f"embedded target ready at {d} ({time.time() - t0:.1f} s)")
    elif a.cmd == "path":
        print(d)
    else:
        print(format_report(heldout_report(d)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
