"""The serving layer reads a screenful at a time: no function of dspark_jax/serve/ (nor of a
command module) runs over 80 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dspark_jax"
MAX_LINES = 80


def _longest(paths) -> list[tuple[int, str]]:
    rows = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                where = f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}"
                rows.append((node.end_lineno - node.lineno + 1, where))
    return sorted(rows, reverse=True)


@pytest.mark.parametrize("where", ["serve", "commands"])
def test_no_function_runs_over_a_screenful(where):
    paths = sorted((PACKAGE / where).glob("*.py"))
    assert paths
    long = [f"{name}: {n} lines" for n, name in _longest(paths) if n > MAX_LINES]
    assert not long, long
