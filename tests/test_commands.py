"""Every `python -m dspark_jax...` command the README names still answers `--help` (the stage
layout keeps command names), and `python -m dspark_jax` lists them."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
COMMANDS = sorted(set(re.findall(r"python -m (dspark_jax(?:\.\w+)*)", README)))


def test_readme_names_the_commands():
    assert {"dspark_jax.train", "dspark_jax.generate", "dspark_jax.eval", "dspark_jax.convert",
            "dspark_jax.models", "dspark_jax.embedded"} <= set(COMMANDS)


@pytest.mark.parametrize("module", COMMANDS)
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")  # earlier tests imported it: harmless
def test_command_answers_help(module, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with pytest.raises(SystemExit) as e:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert e.value.code in (0, None), capsys.readouterr()
    assert "usage" in capsys.readouterr().out.lower()


def test_top_level_lists_every_command_package(capsys):
    from dspark_jax.__main__ import COMMANDS as LISTED, main

    assert main([]) == 0
    out = capsys.readouterr().out
    for name in LISTED:
        assert name in out
    for module in COMMANDS:
        name = module.removeprefix("dspark_jax").lstrip(".")
        assert not name or name in LISTED or name.startswith("io."), f"python -m dspark_jax does not list {name}"
