"""The package graph is a DAG in the order docs/design.md draws: a package imports only packages
below it, modules import each other without cycles, and library code imports at module level
(inside a function only in a command, or for an optional dependency)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dspark_jax"

# Bottom to top; docs/design.md ("Layers") explains each floor.
LAYERS = [
    "cli", "console", "names", "decoding",
    "parallel",
    "target",
    "config",
    "drafter",
    "toolkit",
    "text",
    "io",
    "data",
    "embedded",
    "calibration",
    "scheduler",
    "testing",
    "engine",
    "eval",
    "train",
    "recipe",
    "serve",
    "bench",
    "commands",
    "__main__",
]
# Where a command's parser and `main` live: they import the library inside `main`, so that
# `--help` answers without starting JAX.
COMMAND_PACKAGES = {"commands", "recipe", "__main__"}
# Heavy or optional third-party packages a library function may import when it runs.
OPTIONAL = {"matplotlib", "torch", "transformers", "tensorboardX", "etils", "pyarrow", "datasets", "uvicorn",
            "starlette", "fastapi", "openai", "gguf", "jax.experimental.multihost_utils"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path):
    """(imported dspark_jax module or third-party name, inside a function?) for each import."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())

    def walk(node, in_function):
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, in_function
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - child.level + 1]
                    module = ".".join(base + ([child.module] if child.module else []))
                else:
                    module = child.module
                for alias in child.names:
                    yield f"{module}.{alias.name}", in_function
            else:
                yield from walk(child, inner)

    yield from walk(tree, False)


def _graph():
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges, inner = {}, []
    for name, path in modules.items():
        targets = set()
        for target, in_function in _imports(path):
            if not target.startswith("dspark_jax"):
                if in_function and target.split(".")[0] not in OPTIONAL and target not in OPTIONAL:
                    inner.append((name, target))
                continue
            found = target
            while found not in modules and "." in found:
                found = found.rsplit(".", 1)[0]
            target = found if found != "dspark_jax" or target == "dspark_jax" else target
            if target != name and target != "dspark_jax":
                targets.add(target)
            if in_function:
                inner.append((name, target))
        edges[name] = targets
    return modules, edges, inner


MODULES, EDGES, INNER = _graph()


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_command(module: str) -> bool:
    return _package(module) in COMMAND_PACKAGES or module.endswith(".__main__")


def _is_lazy_package_init(module: str) -> bool:
    """A package's `__init__` may load its public names on first use (PEP 562), so that importing
    the package for a command's --help does not start JAX."""
    return MODULES[module].name == "__init__.py"


def test_every_package_has_a_floor():
    assert {_package(m) for m in MODULES} - {"__init__"} <= set(LAYERS)


def test_packages_import_only_downwards():
    rank = {p: i for i, p in enumerate(LAYERS)}
    upward = sorted(f"{a} -> {b}" for a, bs in EDGES.items() for b in bs
                    if _package(b) != "__init__" and _package(a) != "__init__"
                    and rank[_package(b)] > rank[_package(a)] and not a.endswith(".__main__"))
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_module_cycles():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in EDGES.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(EDGES):
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_library_code_imports_at_module_level():
    late = sorted(f"{a}: {b}" for a, b in INNER if not _is_command(a) and not _is_lazy_package_init(a))
    assert not late, "imports inside functions of library modules:\n" + "\n".join(late)


@pytest.mark.parametrize("source,broken", [
    ("from dspark_jax.train.trainer import Trainer\n", "upward"),
    ("def f():\n    from dspark_jax.io import hf\n", "inner"),
])
def test_the_checks_see_a_violation(tmp_path, source, broken):
    """The graph reader finds an upward edge and a late import in a planted data module."""
    global PACKAGE
    fake = tmp_path / "dspark_jax"
    (fake / "data").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "data" / "__init__.py").write_text("")
    (fake / "data" / "planted.py").write_text(source)
    saved, PACKAGE = PACKAGE, fake
    try:
        _, edges, inner = _graph()
    finally:
        PACKAGE = saved
    if broken == "upward":
        assert any(t.startswith("dspark_jax.train.trainer") for t in edges["dspark_jax.data.planted"])
    else:
        assert ("dspark_jax.data.planted", "dspark_jax.io.hf") in inner
