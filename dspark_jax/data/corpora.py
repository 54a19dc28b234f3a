"""Offline training/evaluation corpora shaped as chat conversations.

Everything is generated locally (no network) and is deterministic for a seed, so a
drafter run can be reproduced bit-for-bit on another machine with the same Python:

* code:  top-level functions/classes of the running interpreter's standard library.
* math:  a seeded synthetic generator of multi-step word problems with worked solutions.
* prose: docstrings of stdlib modules/functions/classes. We use docstrings as the
  "chat-like" domain because they are natural-language explanations that ship with
  every interpreter (offline, license-clean) and pair naturally with a question.

Evaluation hold-out: modules in HELDOUT_MODULES (matched by top-level package name)
never contribute to the "train" split of code or prose, and any training item whose
answer text also occurs in the hold-out is dropped, so evaluation text is unseen.
Math train/heldout are disjoint by construction (question-text hash bucket).

Also: loaders for user data in jsonl (``{"conversations": [...]}`` or ``{"turns": [...]}``).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import os
import random
import sys
import sysconfig
from pathlib import Path

Conversation = list[dict]

# Top-level stdlib modules/packages reserved for evaluation. Fixed so that numbers are
# comparable across runs; chosen to cover parsing, text, numerics and algorithms.
HELDOUT_MODULES = (
    "json",
    "csv",
    "textwrap",
    "statistics",
    "heapq",
    "bisect",
    "fractions",
    "shlex",
    "difflib",
    "string",
)

# Directories/modules skipped entirely: tests, GUI, vendored/third-party and legacy code.
_SKIP_DIRS = {
    "test", "tests", "idlelib", "tkinter", "site-packages", "lib2to3", "turtledemo",
    "ensurepip", "pydoc_data", "__pycache__", "distutils", "lib-dynload", "venv",
}
_SKIP_PREFIXES = ("config-", "_sysconfigdata")
MAX_CHARS = 1500
SPLITS = ("train", "heldout")


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def _user(content: str) -> dict:
    return {"role": "user", "content": content}


def _assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def _truncate(text: str, limit: int = MAX_CHARS) -> str:
    """Cut at the last line break before ``limit`` so code stays line-aligned."""
    if len(text) <= limit:
        return text
    cut = text.rfind("\n", 0, limit)
    return text[: cut if cut > 0 else limit]


# --------------------------------------------------------------------------- stdlib

def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def top_level(module: str) -> str:
    return module.split(".", 1)[0]


@functools.lru_cache(maxsize=1)
def _stdlib_items() -> tuple:
    """Parse the stdlib once: (module, kind, name, source, docstring) tuples, sorted."""
    root = stdlib_dir()
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(_SKIP_PREFIXES)
        )
        for fn in sorted(filenames):
            if fn.endswith(".py") and not fn.startswith(_SKIP_PREFIXES):
                files.append(Path(dirpath) / fn)
    items = []
    for path in sorted(files):
        mod = _module_name(path.relative_to(root))
        if not mod or any(p.startswith("test") for p in mod.split(".")):
            continue
        parsed = parse_top_level(path)
        if parsed is None:
            continue
        mdoc, defs = parsed
        if mdoc:
            items.append((mod, "module", mod, "", mdoc))
        for node, kind, seg in defs:
            items.append((mod, kind, node.name, seg, ast.get_docstring(node) or ""))
    return tuple(items)


def parse_top_level(path):
    """(module docstring, [(node, "function" | "class", source incl. decorators)]) of a Python
    file's top-level definitions; None when the file does not parse."""
    try:
        src = Path(path).read_text(encoding="utf-8")
        tree = ast.parse(src)
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return None
    lines = src.splitlines(keepends=True)
    defs = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            defs.append((node, "class" if isinstance(node, ast.ClassDef) else "function",
                         "".join(lines[start: node.end_lineno])))
    return ast.get_docstring(tree), defs


def _is_heldout(module: str) -> bool:
    return top_level(module) in HELDOUT_MODULES


def _code_pairs(split: str) -> list[tuple[str, str, str, str]]:
    """(module, kind, name, source) of one split; train drops sources seen in heldout."""
    items = [it for it in _stdlib_items() if it[1] != "module" and it[3].strip()]
    held = [it for it in items if _is_heldout(it[0])]
    if split == "heldout":
        return [it[:4] for it in held]
    held_src = {_truncate(it[3]) for it in held}
    return [it[:4] for it in items if not _is_heldout(it[0]) and _truncate(it[3]) not in held_src]


def code_conversations(split: str = "train", seed: int = 0, limit: int | None = None) -> list[Conversation]:
    """Stdlib functions/classes as "write X" or "complete this code" conversations."""
    _check_split(split)
    rng = random.Random(f"code-{split}-{seed}")
    pairs = _code_pairs(split)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    out = []
    for i in order[: limit if limit is not None else len(order)]:
        mod, kind, name, src = pairs[i]
        src = _truncate(src)
        lines = src.splitlines(keepends=True)
        if len(lines) >= 6 and rng.random() < 0.5:
            k = rng.randint(2, min(5, len(lines) // 2))
            prompt = "Complete this code:\n" + "".join(lines[:k])
            answer = "".join(lines[k:])
        else:
            prompt = f"Write the Python {kind} `{name}` from module `{mod}`."
            answer = src
        out.append([_user(prompt), _assistant(answer)])
    return out


def _prose_pairs(split: str) -> list[tuple[str, str]]:
    items = []
    for mod, kind, name, _src, doc in _stdlib_items():
        doc = inspect.cleandoc(doc) if doc else ""
        if len(doc) < 40:
            continue
        qual = mod if kind == "module" else f"{mod}.{name}"
        items.append((mod, qual, _truncate(doc)))
    held = [(q, d) for m, q, d in items if _is_heldout(m)]
    if split == "heldout":
        return held
    held_docs = {d for _, d in held}
    return [(q, d) for m, q, d in items if not _is_heldout(m) and d not in held_docs]


def prose_conversations(split: str = "train", seed: int = 0, limit: int | None = None) -> list[Conversation]:
    """Docstrings as "Explain what `x` does." -> docstring text."""
    _check_split(split)
    rng = random.Random(f"prose-{split}-{seed}")
    pairs = _prose_pairs(split)
    rng.shuffle(pairs)
    pairs = pairs[: limit if limit is not None else len(pairs)]
    return [[_user(f"Explain what `{q}` does."), _assistant(d)] for q, d in pairs]


# ----------------------------------------------------------------------------- math

_NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jia", "Kofi", "Lena")
_ITEMS = ("pencils", "notebooks", "apples", "tickets", "books", "mugs", "stickers", "batteries")


def _t_arith(r: random.Random) -> tuple[str, list[str], int]:
    a, b, c, d = r.randint(2, 99), r.randint(2, 99), r.randint(2, 12), r.randint(1, 200)
    s = a + b
    p = s * c
    ans = p - d
    q = f"Compute ({a} + {b}) * {c} - {d}."
    return q, [f"First, {a} + {b} = {s}.", f"Then, {s} * {c} = {p}.", f"Finally, {p} - {d} = {ans}."], ans


def _t_shopping(r: random.Random) -> tuple[str, list[str], int]:
    n = r.choice(_NAMES)
    i1, i2 = r.sample(_ITEMS, 2)
    q1, p1, q2, p2 = r.randint(2, 9), r.randint(1, 15), r.randint(2, 9), r.randint(1, 15)
    c1, c2 = q1 * p1, q2 * p2
    tot = c1 + c2
    bill = ((tot // 50) + 1) * 50
    ans = bill - tot
    q = (f"{n} buys {q1} {i1} at ${p1} each and {q2} {i2} at ${p2} each, "
         f"and pays with ${bill}. How much change does {n} get?")
    steps = [f"The {i1} cost {q1} * {p1} = {c1} dollars.", f"The {i2} cost {q2} * {p2} = {c2} dollars.",
             f"The total is {c1} + {c2} = {tot} dollars.", f"The change is {bill} - {tot} = {ans} dollars."]
    return q, steps, ans


def _t_rates(r: random.Random) -> tuple[str, list[str], int]:
    n = r.choice(_NAMES)
    v1, h1, v2, h2 = r.randint(20, 90), r.randint(1, 6), r.randint(20, 90), r.randint(1, 6)
    d1, d2 = v1 * h1, v2 * h2
    ans = d1 + d2
    q = (f"{n} drives {h1} hours at {v1} km/h and then {h2} hours at {v2} km/h. "
         f"How many kilometers does {n} drive in total?")
    steps = [f"The first part is {v1} * {h1} = {d1} km.", f"The second part is {v2} * {h2} = {d2} km.",
             f"In total, {d1} + {d2} = {ans} km."]
    return q, steps, ans


def _t_ages(r: random.Random) -> tuple[str, list[str], int]:
    a, b = r.sample(_NAMES, 2)
    age_b, diff, years = r.randint(3, 40), r.randint(1, 30), r.randint(1, 20)
    age_a = age_b + diff
    fa, fb = age_a + years, age_b + years
    ans = fa + fb
    q = (f"{a} is {diff} years older than {b}. {b} is {age_b} years old. "
         f"What will the sum of their ages be in {years} years?")
    steps = [f"{a} is {age_b} + {diff} = {age_a} years old.",
             f"In {years} years, {a} will be {age_a} + {years} = {fa}.",
             f"In {years} years, {b} will be {age_b} + {years} = {fb}.", f"The sum is {fa} + {fb} = {ans}."]
    return q, steps, ans


def _t_percent(r: random.Random) -> tuple[str, list[str], int]:
    n, item = r.choice(_NAMES), r.choice(_ITEMS)
    price, pct, qty = r.randint(1, 40) * 10, r.choice((10, 20, 25, 30, 40, 50)), r.randint(2, 6)
    off = price * pct // 100
    unit = price - off
    ans = unit * qty
    q = (f"A pack of {item} costs ${price}. It is on sale for {pct}% off. "
         f"How much does {n} pay for {qty} packs?")
    steps = [f"The discount is {pct}% of {price} = {off} dollars.", f"One pack costs {price} - {off} = {unit} dollars.",
             f"{qty} packs cost {qty} * {unit} = {ans} dollars."]
    return q, steps, ans


def _t_sharing(r: random.Random) -> tuple[str, list[str], int]:
    n, item = r.choice(_NAMES), r.choice(_ITEMS)
    boxes, per, friends = r.randint(2, 12), r.randint(3, 24), r.randint(2, 9)
    tot = boxes * per
    keep = tot % friends
    ans = tot // friends
    q = (f"{n} has {boxes} boxes with {per} {item} each and shares them equally among "
         f"{friends} friends, keeping the rest. How many {item} does each friend get?")
    steps = [f"There are {boxes} * {per} = {tot} {item}.",
             f"{tot} divided by {friends} is {ans} with remainder {keep}.",
             f"So each friend gets {ans} {item}."]
    return q, steps, ans


MATH_TEMPLATES = (_t_arith, _t_shopping, _t_rates, _t_ages, _t_percent, _t_sharing)


def _math_split_of(question: str) -> str:
    """Deterministic 10 % hold-out bucket by question text: disjoint for any seeds."""
    return "heldout" if hashlib.sha256(question.encode()).digest()[0] % 10 == 0 else "train"


def math_conversations(split: str = "train", seed: int = 0, n: int = 100) -> list[Conversation]:
    """``n`` unique word problems of ``split`` with step-by-step answers ending in "The answer is N."."""
    _check_split(split)
    rng = random.Random(f"math-{split}-{seed}")
    seen, out = set(), []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 200 * n + 1000:
            raise RuntimeError("math generator cannot produce enough unique problems")
        q, steps, ans = rng.choice(MATH_TEMPLATES)(rng)
        if q in seen or _math_split_of(q) != split:
            continue
        seen.add(q)
        out.append([_user(q), _assistant("\n".join(steps) + f"\nThe answer is {ans}.")])
    return out


# --------------------------------------------------------------------------- mixing

def build_corpus(split: str = "train", seed: int = 0, n_code: int = 1000, n_math: int = 1000,
                 n_prose: int = 1000) -> list[Conversation]:
    """Mix the three domains with a seeded shuffle."""
    corpus = (code_conversations(split, seed, n_code) + math_conversations(split, seed, n_math)
              + prose_conversations(split, seed, n_prose))
    random.Random(f"mix-{split}-{seed}").shuffle(corpus)
    return corpus


def serialize_corpus(corpus: list[Conversation]) -> bytes:
    return json.dumps(corpus, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode("utf-8")


def corpus_hash(corpus: list[Conversation]) -> str:
    """sha256 of the canonical JSON serialization (identity of the training text)."""
    return hashlib.sha256(serialize_corpus(corpus)).hexdigest()


def corpus_manifest(corpus: list[Conversation], **params) -> dict:
    """Provenance record: hash plus the interpreter whose stdlib the text came from."""
    return {
        "sha256": corpus_hash(corpus),
        "count": len(corpus),
        "python_version": sys.version,
        "stdlib": str(stdlib_dir()),
        "heldout_modules": list(HELDOUT_MODULES),
        "params": params,
    }


def conversation_text(conv: Conversation) -> str:
    """Plain text of a conversation (e.g. for tokenizer training)."""
    return "\n".join(m["content"] for m in conv)
