"""`python -m dspark_jax gguf import FILE.gguf OUT_DIR`: a GGUF file (llama.cpp's format) as a
Hugging Face checkpoint directory (dspark_jax/io/gguf.py)."""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli import report_user_errors


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax gguf",
                                 description="Import a GGUF model as a Hugging Face checkpoint directory.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="GGUF file -> HF directory (config, safetensors, tokenizer, chat template)")
    imp.add_argument("gguf", help="the .gguf file")
    imp.add_argument("out_dir", help="directory to write (replaced if it exists)")
    imp.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = ap.parse_args(argv)
    from dspark_jax.io.gguf import GGUFError, import_gguf
    try:
        out = import_gguf(args.gguf, args.out_dir, args.dtype)
    except GGUFError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
