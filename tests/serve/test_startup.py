"""Which drafter `python -m dspark_jax serve` serves when none is named, what its startup line
says, and the access flags (no request is generated here: builds only, nothing compiles)."""

from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (pip install -e .[serve])")


def _build(target, **kw):
    from dspark_jax.serve import build

    _, served = build(str(target) if target is not None else None, slots=2, max_len=64, **kw)
    served.loop.stop()
    return served


def test_target_dir_without_a_drafter_serves_target_only_not_the_embedded_targets(
        embedded_tiny_dir, tiny_dspark_drafter_dir, monkeypatch):
    """--target DIR used to pick up runs/dspark/drafter (trained for the embedded target) and
    refuse to start on any other target; that default belongs to the embedded target only."""
    from dspark_jax.serve import defaults

    monkeypatch.setattr(defaults, "DEFAULT_DRAFTER", tiny_dspark_drafter_dir)  # as if the embedded run had one
    served = _build(embedded_tiny_dir)
    assert served.loop.engine.mode == "ar" and served.about["drafter"] is None
    assert "no drafter for this target" in served.about["drafter_why"]


def test_a_drafter_in_or_beside_the_target_is_served_when_it_was_trained_for_it(
        embedded_tiny_dir, tiny_dspark_drafter_dir, tmp_path):
    from dspark_jax.commands.serve import startup_line
    from dspark_jax.io.drafter_dir import CONFIG_FILE
    from dspark_jax.serve.served import Access

    root = tmp_path / "models"
    root.mkdir()
    (root / "target").symlink_to(embedded_tiny_dir, target_is_directory=True)
    shutil.copytree(tiny_dspark_drafter_dir, root / "drafter")
    served = _build(root / "target")
    assert served.loop.engine.mode == "dspark" and served.about["drafter"] == str(root / "drafter")
    line = startup_line(served, Access(), "127.0.0.1", 8000)
    assert f"drafter {root / 'drafter'} (found in or beside the target)" in line
    # by default the drafter kind's scheduling, on a table the engine measures when it warms up
    assert "policy production, skip rule known; cost table own, measured at start-up" in line
    assert "API key off" in line
    assert "2048 messages; read timeouts 30 s headers, 60 s body" in line

    cfg = root / "drafter" / CONFIG_FILE  # trained for another target: not used, and the server still starts
    data = json.loads(cfg.read_text())
    data["target_fingerprint"] = "0" * 16
    cfg.write_text(json.dumps(data))
    served = _build(root / "target")
    assert served.loop.engine.mode == "ar" and served.about["drafter"] is None
    assert "target-only" in startup_line(served, Access(), "127.0.0.1", 8000)

    served = _build(root / "target", drafter="none")
    assert served.about["drafter_why"] == "target-only (--drafter none)"


def test_access_flags_and_the_api_key_from_the_environment(monkeypatch):
    from dspark_jax.commands.serve import API_KEY_ENV, parse_args

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = parse_args([])
    assert args.api_key is None and args.cors_origins == "" and not args.docs and not args.no_warmup
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert parse_args([]).api_key == "from-env"
    assert (args.max_messages, args.header_timeout, args.body_timeout) == (2048, 30.0, 60.0)
    args = parse_args(["--api-key", "flag", "--cors-origins", "https://a.example,https://b.example", "--docs",
                       "--no-warmup", "--max-body-bytes", "1000", "--max-prompt-chars", "50", "--max-messages", "7",
                       "--header-timeout", "2.5", "--body-timeout", "4"])
    assert (args.api_key, args.cors_origins, args.docs, args.no_warmup, args.max_body_bytes, args.max_prompt_chars,
            args.max_messages, args.header_timeout, args.body_timeout) == (
        "flag", "https://a.example,https://b.example", True, True, 1000, 50, 7, 2.5, 4.0)
