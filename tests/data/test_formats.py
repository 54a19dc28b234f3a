"""Users' chat formats read into conversations, and `prepare` turning answered chats into a
training set whose loss mask covers exactly the assistant answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dspark_jax.data.formats import RecordError, read_conversations

CONV = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "5."}, {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "8."}]
SHAREGPT = [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "What is 2 + 3?"},
            {"from": "gpt", "value": "5."}, {"from": "human", "value": "And 4 + 4?"}, {"from": "gpt", "value": "8."}]
PARTS = [{**m, "content": [{"type": "text", "text": m["content"][:2]}, {"type": "text", "text": m["content"][2:]}]}
         for m in CONV]


@pytest.mark.parametrize("record", [{"messages": CONV}, {"conversations": CONV}, {"conversations": SHAREGPT},
                                    {"messages": PARTS}, {"conversation": json.dumps(CONV)}, CONV],
                         ids=["openai", "role_content", "sharegpt", "content_parts", "json_string", "bare_list"])
@pytest.mark.parametrize("container", ["jsonl", "json_array", "parquet"])
def test_every_format_reads_the_same_conversation(tmp_path, record, container):
    if container == "jsonl":
        p = tmp_path / "d.jsonl"
        p.write_text("\n".join(json.dumps(record) for _ in range(3)) + "\n")
    elif container == "json_array":
        p = tmp_path / "d.json"
        p.write_text(json.dumps([record] * 3, indent=1))
    else:
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        # a row is an object: a bare list becomes a JSON-string column, as exports often store it
        rec = {"messages": record} if isinstance(record, list) else record
        row = {k: (json.dumps(v) if not isinstance(v, str) else v) for k, v in rec.items()}
        p = tmp_path / "d.parquet"
        pq.write_table(pa.Table.from_pylist([row] * 3), p)
    assert read_conversations(p) == [CONV] * 3


def test_turns_are_prompts():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "t.jsonl"
        p.write_text(json.dumps({"turns": ["Hi?", "More?"]}) + "\n")
        assert read_conversations(p) == [[{"role": "user", "content": "Hi?"}]]


def test_bad_records_name_file_and_line_or_are_skipped_and_counted(tmp_path):
    p = tmp_path / "bad.jsonl"
    lines = [{"messages": CONV}, {"messages": [{"from": "alien", "value": "x"}]}, "not json",
             {"messages": [{"role": "user", "content": {"image": 1}}]}, {"text": "x"}, {"messages": CONV}]
    p.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    with pytest.raises(RecordError, match=rf"{p.name}:2: message 0 has unknown ShareGPT speaker 'alien'"):
        read_conversations(p)
    stats = {}
    got = read_conversations(p, on_error="skip", stats=stats)
    assert got == [CONV, CONV] and stats["skipped"] == 4
    assert [e.split(": ")[0].rsplit(":", 1)[-1] for e in stats["errors"]] == ["2", "3", "4", "5"]
    assert "invalid JSON" in stats["errors"][1] and "string or a list of text parts" in stats["errors"][2]
    assert 'no "messages", "conversations" or "turns"' in stats["errors"][3]


def test_missing_readers_say_what_to_install(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_datasets(name, *a, **k):
        if name == "datasets":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(RecordError, match="pip install datasets"):
        read_conversations(tmp_path)


def test_prepare_masks_exactly_the_answers(embedded_tiny_dir, tmp_path, capsys):
    from dspark_jax.commands.prepare import main
    from dspark_jax.data.dataset import TokenDataset
    from dspark_jax.text.tokenizer import Tokenizer

    src = tmp_path / "chats.jsonl"
    src.write_text("\n".join([json.dumps({"conversations": SHAREGPT}), json.dumps({"messages": CONV[:2]}),
                              json.dumps({"messages": PARTS})]) + "\n")
    out = tmp_path / "ds"
    assert main([str(src), "--out", str(out), "--target", str(embedded_tiny_dir)]) == 2  # record 1 has no answer
    assert "no assistant answer" in capsys.readouterr().err and not out.exists()
    assert main([str(src), "--out", str(out), "--target", str(embedded_tiny_dir), "--skip-bad"]) == 0
    assert "2 of 3 records" in capsys.readouterr().out
    ds, tok = TokenDataset(out), Tokenizer.load(embedded_tiny_dir)
    assert len(ds) == 2
    for i in range(2):
        rec = ds[i]
        masked = tok.decode(rec["tokens"][rec["loss_mask"]].tolist())
        assert "5." in masked and "8." in masked and "2 + 3" not in masked and "Be brief" not in masked
        assert rec["loss_mask"].sum() < len(rec["tokens"]) / 2
    np.testing.assert_array_equal(ds[0]["tokens"], ds[1]["tokens"])  # ShareGPT == OpenAI content parts
