"""A second held-out code source: functions of installed dependencies (numpy, jax, flax, optax).

Why: the embedded corpora's held-out stdlib modules yield only ~108 code prompts, and the
evaluation wants >= 200. The embedded target and every drafter were trained on the
standard library only (`corpora.py` skips ``site-packages``), so the pure-Python sources
of the project's own dependencies are unseen code of the same language and style.

Prompts use exactly the corpus's code templates ("Write the Python {kind} `{name}` from
module `{mod}`." or "Complete this code:\\n" + the first 2-5 lines). Selection is
deterministic for a given set of installed versions: top-level functions/classes are
ranked by sha256 of ``module:name`` (so a new release only moves the items it adds or
removes), and any source that also occurs in the stdlib corpus is dropped. The prompts
therefore depend on the installed versions of these packages: :func:`source_versions`
records them next to every result.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import random
from pathlib import Path

from dspark_jax.data.corpora import (
    _SKIP_DIRS,
    _assistant,
    _stdlib_items,
    _truncate,
    _user,
    parse_top_level,
)

PACKAGES = ("numpy", "jax", "flax", "optax")
MIN_LINES = 3  # one-liners make degenerate "write X" prompts

Conversation = list[dict]


def source_versions(packages=PACKAGES) -> dict[str, str | None]:
    """Installed version of each package the prompts are drawn from (None if absent)."""
    out = {}
    for p in packages:
        try:
            out[p] = importlib.metadata.version(p)  # distribution name = import name here
        except importlib.metadata.PackageNotFoundError:
            out[p] = None
    return out


def _package_root(pkg: str) -> Path | None:
    spec = importlib.util.find_spec(pkg)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(sorted(spec.submodule_search_locations)[0])


def _files(root: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(("test", "_test")))
        out += [Path(dirpath) / f for f in sorted(filenames)
                if f.endswith(".py") and not f.startswith(("test", "conftest"))]
    return sorted(out)


@functools.lru_cache(maxsize=4)
def package_items(packages: tuple[str, ...] = PACKAGES) -> tuple:
    """(module, kind, name, source) of top-level functions/classes, ranked by sha256("module:name")."""
    stdlib_src = {_truncate(it[3]) for it in _stdlib_items() if it[3].strip()}
    items, seen = [], set()
    for pkg in packages:
        root = _package_root(pkg)
        if root is None:
            continue
        for path in _files(root):
            rel = path.relative_to(root.parent).with_suffix("")
            parts = list(rel.parts[:-1]) if rel.name == "__init__" else list(rel.parts)
            mod = ".".join(parts)
            parsed = parse_top_level(path)
            if parsed is None:
                continue
            for node, kind, seg in parsed[1]:
                body = _truncate(seg)
                if len(body.splitlines()) < MIN_LINES or body in stdlib_src or body in seen:
                    continue
                seen.add(body)
                items.append((mod, kind, node.name, seg))
    items.sort(key=lambda it: (hashlib.sha256(f"{it[0]}:{it[2]}".encode()).hexdigest(), it[0], it[2]))
    return tuple(items)


def code_conversations(n: int, seed: int = 0, packages: tuple[str, ...] = PACKAGES,
                       exclude_prompts=()) -> list[Conversation]:
    """``n`` code conversations in the corpus's templates, distinct prompts, none in ``exclude_prompts``."""
    rng = random.Random(f"code-deps-{seed}")
    skip = set(exclude_prompts)
    out = []
    for mod, kind, name, src in package_items(tuple(packages)):
        if len(out) >= n:
            break
        src = _truncate(src)
        lines = src.splitlines(keepends=True)
        if len(lines) >= 6 and rng.random() < 0.5:
            k = rng.randint(2, min(5, len(lines) // 2))
            prompt, answer = "Complete this code:\n" + "".join(lines[:k]), "".join(lines[k:])
        else:
            prompt, answer = f"Write the Python {kind} `{name}` from module `{mod}`.", src
        if prompt in skip:
            continue
        skip.add(prompt)
        out.append([_user(prompt), _assistant(answer)])
    return out
