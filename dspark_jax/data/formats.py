"""Users' chat data in the formats it comes in, as our conversations (lists of {role, content}).

Records: OpenAI `{"messages": [...]}`, `{"conversations": [...]}` with role/content or ShareGPT's
from/value (human / gpt / system / ...), content as a string or a list of text parts, and the
reference prompt sets' `{"turns": [...]}` (consecutive user turns; prompts only). Files: JSONL,
a JSON array, parquet (pyarrow), or a directory written by `datasets.save_to_disk`. A bad record
is named with its file and line (or row); `on_error="skip"` counts it and goes on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

ROLES = ("system", "user", "assistant", "tool")
# ShareGPT `from` values and their roles
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system",
                  "tool": "tool", "function": "tool", "observation": "tool"}


class RecordError(ValueError):
    pass


def _content(c, where: str, j: int) -> str:
    if isinstance(c, str):
        return c
    if isinstance(c, list):  # OpenAI content parts: keep the text ones, in order
        parts = []
        for p in c:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and p.get("type", "text") == "text" and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise RecordError(f"{where}: message {j} has a content part that is not text ({json.dumps(p)[:80]})")
        return "".join(parts)
    raise RecordError(f"{where}: message {j} content must be a string or a list of text parts, got {type(c).__name__}")


def _message(m, where: str, j: int) -> dict:
    if not isinstance(m, dict):
        raise RecordError(f"{where}: message {j} must be an object")
    if "role" in m and "content" in m:
        role = m["role"]
        content = m["content"] if m["content"] is not None else ""
    elif "from" in m and "value" in m:
        role = SHAREGPT_ROLES.get(str(m["from"]).lower())
        if role is None:
            raise RecordError(f"{where}: message {j} has unknown ShareGPT speaker {m['from']!r} "
                              f"(known: {', '.join(sorted(SHAREGPT_ROLES))})")
        content = m["value"]
    else:
        raise RecordError(f"{where}: message {j} needs \"role\" and \"content\" (OpenAI) "
                          "or \"from\" and \"value\" (ShareGPT)")
    if role not in ROLES:
        raise RecordError(f"{where}: message {j} has unknown role {role!r} (known: {', '.join(ROLES)})")
    return {"role": role, "content": _content(content, where, j)}


def to_conversation(obj, where: str) -> list[dict]:
    """One record -> a conversation; raises RecordError naming `where` and the problem."""
    if isinstance(obj, list):
        msgs = obj
    elif not isinstance(obj, dict):
        raise RecordError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    elif "turns" in obj and "conversations" not in obj and "messages" not in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise RecordError(f"{where}: \"turns\" must be a non-empty list of strings")
        return [{"role": "user", "content": turns[0]}]
    else:
        key = next((k for k in ("messages", "conversations", "conversation") if k in obj), None)
        if key is None:
            raise RecordError(f"{where}: no \"messages\", \"conversations\" or \"turns\" "
                              f"(keys: {', '.join(list(obj)[:8])})")
        msgs = obj[key]
        if isinstance(msgs, str):  # some exports store the list as a JSON string
            try:
                msgs = json.loads(msgs)
            except json.JSONDecodeError:
                raise RecordError(f"{where}: \"{key}\" is a string that is not a JSON list") from None
    if not isinstance(msgs, list) or not msgs:
        raise RecordError(f"{where}: the message list must be non-empty")
    return [_message(m, where, j) for j, m in enumerate(msgs)]


def _rows(path: Path) -> Iterator[tuple[str, object]]:
    """(where, raw record) for every record of a file or saved dataset."""
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise RecordError(f"{path} is a directory: reading a dataset saved by `datasets.save_to_disk` needs "
                              "`pip install datasets`") from None
        ds = datasets.load_from_disk(str(path))
        splits = ds.items() if hasattr(ds, "items") else [("", ds)]
        for split, d in splits:
            for i, row in enumerate(d):
                yield f"{path}{'/' + split if split else ''}:row {i}", row
        return
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise RecordError(f"{path}: reading parquet needs `pip install pyarrow`") from None
        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
        return
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl" and text.lstrip().startswith("["):  # one JSON array of records
        try:
            arr = json.loads(text)
        except json.JSONDecodeError as e:
            raise RecordError(f"{path}: invalid JSON array ({e.msg} at line {e.lineno})") from None
        for i, row in enumerate(arr):
            yield f"{path}:record {i}", row
        return
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield f"{path}:{lineno}", json.loads(line)
        except json.JSONDecodeError as e:
            yield f"{path}:{lineno}", RecordError(f"{path}:{lineno}: invalid JSON ({e.msg})")


def read_conversations(paths, on_error: str = "raise", stats: dict | None = None) -> list[list[dict]]:
    """Every record of every path as a conversation. `on_error`: "raise" (the first bad record is
    an error naming its file and line) or "skip" (counted in `stats["skipped"]`, first few kept in
    `stats["errors"]`)."""
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    stats = stats if stats is not None else {}
    stats.setdefault("skipped", 0)
    stats.setdefault("errors", [])
    out = []
    for p in ([paths] if isinstance(paths, (str, Path)) else paths):
        for where, raw in _rows(Path(p)):
            try:
                if isinstance(raw, RecordError):
                    raise raw
                out.append(to_conversation(raw, where))
            except RecordError as e:
                skip_or_raise(e, on_error, stats)
    return out


def skip_or_raise(e: RecordError, on_error: str, stats: dict) -> None:
    """A bad record: raise it, or count it (keeping the first few messages) and go on."""
    if on_error == "raise":
        raise e
    stats["skipped"] += 1
    if len(stats["errors"]) < 5:
        stats["errors"].append(str(e))
