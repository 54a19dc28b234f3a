"""`python -m dspark_jax prepare`: users' answered chats -> a training dataset (token ids and
the assistant loss mask), in the target's tokenizer and chat template.

    python -m dspark_jax prepare chats.jsonl more.parquet --target /ckpt/Qwen3-8B --out data/train

Formats: OpenAI messages, ShareGPT, content parts, turns; JSONL, JSON arrays, parquet,
`datasets.save_to_disk` directories (dspark_jax/data/formats.py). Chats whose answers should come
from the target itself go through `python -m dspark_jax regenerate` instead.
"""

from __future__ import annotations

import argparse
import sys

from dspark_jax.cli import report_user_errors


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax prepare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("inputs", nargs="+", help="chat files (.jsonl, .json, .parquet) or saved datasets directories")
    ap.add_argument("--out", required=True, help="output dataset directory (data.path of a training config)")
    ap.add_argument("--target", default=None, help="the target's HF directory: its tokenizer and chat template "
                                                   "(default: the embedded target)")
    ap.add_argument("--max-len", type=int, default=4096, help="tokens per record, longer ones are cut (default 4096)")
    ap.add_argument("--skip-bad", action="store_true",
                    help="skip and count bad records instead of stopping at the first")
    ap.add_argument("--thinking", choices=("auto", "on", "off"), default="auto",
                    help="templates with a thinking switch (Qwen3): pass enable_thinking on / off "
                         "(auto: the template's default)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    args = ap.parse_args(argv)
    from dspark_jax.data.prepare import prepare
    from dspark_jax.embedded.target import embedded_target_dir

    try:
        target = args.target or (lambda: embedded_target_dir(build=True, progress=True))
        c = prepare(args.inputs, args.out, target, max_len=args.max_len,
                    on_error="skip" if args.skip_bad else "raise", overwrite=args.overwrite, thinking=args.thinking)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[prepare] {c['written']} of {c['read']} records -> {args.out} ({c['tokens']} tokens, {c['loss_tokens']} "
          f"trained on); skipped {c['skipped']}")
    for e in c["errors"]:
        print(f"[prepare]   skipped: {e}")
    return 0
