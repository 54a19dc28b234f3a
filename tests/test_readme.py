"""The README's commands and snippets are real: every `python -m dspark_jax...` command in its
code blocks (and inline code) names a module that answers `--help`, every `--flag` it uses
appears in that command's help (a subcommand's own help where it has subcommands, e.g.
`python -m dspark_jax convert export --help`), the Python snippets define every name they use,
and the Qwen3 snippet runs (on the tiny embedded target) with valid feature layers."""

from __future__ import annotations

import ast
import builtins
import json
import re
import shlex
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCES = re.findall(r"```(\w*)\n(.*?)```", README, re.S)
FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")


def _commands() -> list[tuple[str, list[str]]]:
    """(command, argument tokens) of each `python -m dspark_jax <command>` (or `python -m dspark_jax.train`)."""
    texts = []
    for lang, body in FENCES:
        if lang in ("bash", "sh", "shell", "console", ""):
            body = body.replace("\\\n", " ")  # line continuations
            texts += [re.sub(r"\s#.*$", "", line) for line in body.splitlines()]  # drop comments
    prose = re.sub(r"```.*?```", "", README, flags=re.S)
    texts += re.findall(r"`(python -m dspark_jax[^`]*)`", prose)
    found = []
    for text in texts:
        for m in re.finditer(r"python -m dspark_jax(\.train\b)?((?:(?!&&|;|\|\|).)*)", text):
            args = m.group(2).replace("|", " ").split()  # `import|export`, `a\|b` in tables
            if m.group(1):
                found.append(("train", args))
            elif args and not args[0].startswith("-"):
                found.append((args[0], args[1:]))
    return found


COMMANDS = _commands()

HELPER = r"""
import contextlib, io, json, re, sys, warnings
from dspark_jax.__main__ import main
warnings.simplefilter("ignore")

def help_of(argv):
    buf = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            code = main(list(argv) + ["--help"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:
            code, _ = 1, buf.write(repr(e))
    return {"code": code, "text": buf.getvalue()}

out = {}
for module, first in json.loads(sys.argv[1]):
    if module not in out:
        out[module] = help_of([module])
    # a subcommand: a plain word that the module's help names (`{import,export}` or a listing)
    named = re.fullmatch(r"[a-z][\w-]*", first) and re.search(rf"(?<![\w-]){re.escape(first)}(?![\w-])",
                                                             out[module]["text"])
    if named and f"{module} {first}" not in out:
        sub = help_of([module, first])
        if sub["code"] == 0 and "usage" in sub["text"].lower():
            out[f"{module} {first}"] = sub
print("HELP-JSON " + json.dumps(out))
"""


@lru_cache(maxsize=1)
def _helps() -> dict:
    """Every module's --help (and its subcommands' that the README uses), in one subprocess."""
    wanted = sorted({(m, next((a for a in args if not a.startswith("-")), "")) for m, args in COMMANDS})
    r = subprocess.run([sys.executable, "-c", HELPER, json.dumps(wanted)], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    line = next((x for x in r.stdout.splitlines() if x.startswith("HELP-JSON ")), None)
    assert line is not None, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(line.removeprefix("HELP-JSON "))


def test_readme_has_the_qwen3_path():
    modules = {m for m, _ in COMMANDS}
    assert {"prepare", "regenerate", "plan", "train", "eval", "convert", "serve"} <= modules
    assert "hf download Qwen/Qwen3-8B --local-dir" in README
    assert 'pip install -e ".[test]" && python -m pytest -q' in README  # .ci/run greps for it
    assert "Python >= 3.11" in README


@pytest.mark.parametrize("module,args", COMMANDS, ids=[" ".join([m, *a])[:80] for m, a in COMMANDS])
def test_readme_command_and_flags_exist(module, args):
    helps = _helps()
    top = helps[module]
    assert top["code"] == 0 and "usage" in top["text"].lower(), (
        f"python -m dspark_jax {module} --help:\n{top['text'][-2000:]}")
    first = next((a for a in args if not a.startswith("-")), "")
    text = helps.get(f"{module} {first}", top)["text"]
    flags = {f for a in args for f in FLAG.findall(a)}
    missing = sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", text))
    assert not missing, f"python -m dspark_jax {module} {' '.join(args)}: {missing} not in its --help"


def _python_snippets() -> list[str]:
    return [body for lang, body in FENCES if lang == "python"]


def _undefined_names(src: str) -> set[str]:
    tree = ast.parse(src)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound


def test_python_snippets_define_every_name():
    snippets = _python_snippets()
    assert len(snippets) >= 2
    for src in snippets:
        assert not _undefined_names(src), (src, _undefined_names(src))


def test_qwen3_snippet_layer_ids_fit_qwen3_8b():
    from dspark_jax.config import from_cli
    from dspark_jax.drafter import default_layer_ids

    (src,) = [s for s in _python_snippets() if "load_target(" in s]
    cfg = from_cli(["qwen3_8b_dspark"])
    n = cfg.target.model.num_layers
    assert n == 36
    literal = [tuple(int(x) for x in t.split(",")) for t in re.findall(r"\((\d+(?:, \d+)+)\)", src)]
    assert all(0 <= i < n for t in literal for i in t), literal  # e.g. the comment's (1, 9, 17, 25, 33)
    assert default_layer_ids(n, 5) in literal  # the comment states what the code computes
    assert tuple(cfg.drafter.target_layer_ids) == default_layer_ids(n, 5)


def test_qwen3_snippet_runs_on_the_tiny_target(embedded_tiny_dir, capsys):
    (src,) = [s for s in _python_snippets() if "load_target(" in s]
    assert '"/path/to/Qwen3-8B"' in src
    exec(compile(src.replace('"/path/to/Qwen3-8B"', repr(str(embedded_tiny_dir))), "README:qwen3", "exec"), {})
    shapes = capsys.readouterr().out.split("(")
    assert len(shapes) == 4 and shapes[3].startswith("1, "), shapes  # features [1, T, 5, H]


def test_command_lines_are_shell_words():
    for lang, body in FENCES:
        if lang == "bash":
            shlex.split(body.replace("\\\n", " "), comments=True)  # balanced quotes
