"""`python -m dspark_jax prepare`: users' answered chats -> a training dataset (token ids and
the assistant loss mask), in the target's tokenizer and chat template.

    python -m dspark_jax prepare chats.jsonl more.parquet --target /ckpt/Qwen3-8B --out data/train

Formats: see `dspark_jax.data.formats` (OpenAI messages, ShareGPT, content parts, turns; JSONL,
JSON arrays, parquet, `datasets.save_to_disk` directories). Chats whose answers should come from
the target itself go through `python -m dspark_jax regenerate` instead.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from dspark_jax.cli import report_user_errors


def prepare(inputs, out, target=None, *, max_len: int = 4096, on_error: str = "raise", overwrite: bool = False,
            thinking: str = "auto") -> dict:
    """Write `out` (a DatasetWriter dataset); returns counts. A chat without an assistant answer
    (within `max_len` tokens) is a bad record."""
    from dspark_jax.data.chat import encode_chat, load_chat_template
    from dspark_jax.data.dataset import DatasetWriter
    from dspark_jax.data.formats import RecordError, read_conversations, skip_or_raise
    from dspark_jax.data.tokenizer import Tokenizer

    stats: dict = {}
    convs = read_conversations(inputs, on_error=on_error, stats=stats)  # bad input fails before any target work
    if target is None:
        from dspark_jax.embedded.target import embedded_target_dir

        target = embedded_target_dir(build=True, progress=True)
    tok = Tokenizer.load(target)
    template = load_chat_template(target)
    kw = {} if thinking == "auto" else {"enable_thinking": thinking == "on"}
    counts = {"read": len(convs) + stats["skipped"], "written": 0, "skipped": stats["skipped"], "tokens": 0,
              "loss_tokens": 0, "errors": list(stats["errors"])}
    with DatasetWriter(out, overwrite=overwrite, vocab_size=tok.vocab_size, tokenizer_hash=tok.fingerprint,
                       info={"prepare": {"inputs": [str(p) for p in inputs], "target": str(target),
                                         "max_len": max_len, "thinking": thinking}}) as w:
        for i, conv in enumerate(convs):
            try:
                if not any(m["role"] == "assistant" and m["content"] for m in conv):
                    raise RecordError(f"record {i}: no assistant answer to train on (regenerate answers with "
                                      "python -m dspark_jax regenerate)")
                ids, mask = encode_chat(tok, conv, template, max_len=max_len, **kw)
                if not mask.any():
                    raise RecordError(f"record {i}: its first answer starts after max_len={max_len} tokens")
            except RecordError as e:
                skip_or_raise(e, on_error, counts)
                continue
            w.add(ids, mask)
            counts["written"] += 1
            counts["tokens"] += int(len(ids))
            counts["loss_tokens"] += int(mask.sum())
    return counts


@report_user_errors
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dspark_jax prepare", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("inputs", nargs="+", help="chat files (.jsonl, .json, .parquet) or saved datasets directories")
    ap.add_argument("--out", required=True, help="output dataset directory (data.path of a training config)")
    ap.add_argument("--target", default=None, help="the target's HF directory: its tokenizer and chat template "
                                                   "(default: the embedded target)")
    ap.add_argument("--max-len", type=int, default=4096, help="tokens per record, longer ones are cut (default 4096)")
    ap.add_argument("--skip-bad", action="store_true", help="skip and count bad records instead of stopping at the first")
    ap.add_argument("--thinking", choices=("auto", "on", "off"), default="auto",
                    help="templates with a thinking switch (Qwen3): pass enable_thinking on / off (auto: the template's default)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing dataset")
    args = ap.parse_args(argv)
    try:
        c = prepare(args.inputs, args.out, args.target, max_len=args.max_len,
                    on_error="skip" if args.skip_bad else "raise", overwrite=args.overwrite, thinking=args.thinking)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[prepare] {c['written']} of {c['read']} records -> {args.out} ({c['tokens']} tokens, {c['loss_tokens']} "
          f"trained on); skipped {c['skipped']}")
    for e in c["errors"]:
        print(f"[prepare]   skipped: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
