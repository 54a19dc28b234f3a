"""Users' answered chats -> a training dataset (token ids and the assistant loss mask), in the
target's tokenizer and chat template (`python -m dspark_jax prepare`).

Formats: see `dspark_jax.data.formats` (OpenAI messages, ShareGPT, content parts, turns; JSONL,
JSON arrays, parquet, `datasets.save_to_disk` directories). Chats whose answers should come from
the target itself go through `python -m dspark_jax regenerate` instead.
"""

from __future__ import annotations

from dspark_jax.data.dataset import DatasetWriter
from dspark_jax.data.formats import RecordError, read_conversations, skip_or_raise
from dspark_jax.text.chat import encode_chat, load_chat_template
from dspark_jax.text.tokenizer import Tokenizer


def prepare(inputs, out, target, *, max_len: int = 4096, on_error: str = "raise", overwrite: bool = False,
            thinking: str = "auto") -> dict:
    """Write `out` (a DatasetWriter dataset); returns counts. A chat without an assistant answer
    (within `max_len` tokens) is a bad record. `target`: the target's directory, or a function
    returning it, called once the inputs have been read (bad input fails before any target work)."""
    stats: dict = {}
    convs = read_conversations(inputs, on_error=on_error, stats=stats)
    target = target() if callable(target) else target
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
