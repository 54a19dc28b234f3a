"""Every command answers `--help` through `python -m dspark_jax <command>`, the README names only
commands that exist, and the package has no command shims besides the dispatcher and `train`."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dspark_jax.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
README_COMMANDS = set(re.findall(r"python -m dspark_jax ([a-z][\w-]*)", README))


def test_readme_names_commands_that_exist():
    assert {"generate", "eval", "convert", "models", "embedded", "serve"} <= README_COMMANDS
    assert README_COMMANDS <= set(COMMANDS), README_COMMANDS - set(COMMANDS)
    assert "python -m dspark_jax.train" in README  # what the TPU launch scripts run


@pytest.mark.parametrize("name", sorted(COMMANDS))
@pytest.mark.filterwarnings("ignore:.*found in sys.modules:RuntimeWarning")
def test_command_answers_help(name, capsys):
    try:
        code = main([name, "--help"])
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    out = capsys.readouterr().out
    assert f"usage: python -m dspark_jax {name}" in out or (name == "train" and "usage" in out.lower()), out[:400]


def test_listing_and_unknown_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name, command in COMMANDS.items():
        assert f"  {name} " in out and command.summary in out
    assert main(["generat"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'generat'" in err and "generate" in err


def test_console_script_and_module_run_the_dispatcher():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"dspark-jax": "dspark_jax.__main__:main"}
    r = subprocess.run([sys.executable, "-m", "dspark_jax", "simulate", "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0 and "usage: python -m dspark_jax simulate" in r.stdout, r.stderr[-2000:]


def test_no_shim_packages_at_the_top_level():
    """A top-level folder is a stage with code, never a 5-line `__main__` that forwards elsewhere."""
    for pkg in (ROOT / "dspark_jax").iterdir():
        if pkg.is_dir() and (pkg / "__init__.py").is_file():
            modules = [p for p in pkg.rglob("*.py") if p.name != "__init__.py"]
            assert modules != [pkg / "__main__.py"], f"{pkg.name}/ holds only a __main__.py"


@pytest.mark.parametrize("old,argv,usage", [
    ("train-plan", ["train-plan", "--help"], "usage: python -m dspark_jax plan train"),
    ("engine-plan", ["engine-plan", "--help"], "usage: python -m dspark_jax plan engine"),
    ("tpu-memory", ["tpu-memory", "--help"], "usage: python -m dspark_jax bench tpu-memory"),
    ("tpu-predict", ["tpu-predict", "--help"], "usage: python -m dspark_jax bench tpu-predict"),
    ("gguf import", ["gguf", "import", "--help"], "usage: python -m dspark_jax convert gguf"),
])
def test_an_old_name_runs_the_new_command_after_a_one_line_notice(old, argv, usage, capsys):
    from dspark_jax.__main__ import ALIASES

    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    assert code in (0, None)
    captured = capsys.readouterr()
    assert usage in captured.out, captured.out[:400]
    new = " ".join(ALIASES[argv[0]].new)
    assert captured.err == f"note: `{old}` is now `{new}`; the old name goes away in the next release\n"
    assert argv[0] not in COMMANDS


def test_every_command_is_a_module_of_the_command_package():
    """One command layer: each command's module is in dspark_jax.commands, and `python -m
    dspark_jax.train` runs the train command."""
    outside = {n: c.module for n, c in COMMANDS.items() if not c.module.startswith("dspark_jax.commands.")}
    assert outside == {}, outside
    train_main = (ROOT / "dspark_jax" / "train" / "__main__.py").read_text()
    assert "from dspark_jax.commands.train import main" in train_main


def test_command_modules_hold_no_library_functions():
    """A command parses, calls the library and prints: at module level it imports only the
    JAX-free modules its parser needs (the library comes inside `main`). The benchmarks
    (commands/bench/) are programs that measure, and may import what they time at the top."""
    import ast

    allowed = ("dspark_jax.cli", "dspark_jax.console", "dspark_jax.names", "dspark_jax.commands",
               "dspark_jax.serve.defaults", "dspark_jax.io.cache", "dspark_jax.io.models", "dspark_jax.io.gguf",
               "dspark_jax.data.regen_defaults", "dspark_jax.decoding.params", "dspark_jax.recipe.recipes")
    for path in sorted((ROOT / "dspark_jax" / "commands").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dspark_jax"):
                assert node.module.startswith(allowed), f"{path.name}: module-level import of {node.module}"


def test_the_embedded_command_lists_the_presets_it_can_build():
    from dspark_jax.commands.embedded import PRESET_NAMES
    from dspark_jax.embedded.target import PRESETS

    assert PRESET_NAMES == tuple(sorted(PRESETS))
