"""The second held-out code source: deterministic, distinct, in the corpus's templates, unseen in training."""

import re

import pytest

from dspark_jax.data import corpora
from dspark_jax.data import heldout_code as H
from dspark_jax.eval.evaluate import _domain, default_conversations

_WRITE = re.compile(r"^Write the Python (function|class) `\w+` from module `[\w.]+`\.$")
SMALL = ("optax",)  # the smallest dependency keeps the tests fast


def test_prompts_use_the_corpus_templates_and_are_distinct():
    convs = H.code_conversations(60, packages=SMALL)
    assert len(convs) == 60
    prompts = [c[0]["content"] for c in convs]
    assert len(set(prompts)) == 60
    for c, p in zip(convs, prompts):
        assert [m["role"] for m in c] == ["user", "assistant"] and c[1]["content"].strip()
        assert _WRITE.match(p) or p.startswith("Complete this code:\n"), p
        assert _domain(c) == "code"
        assert "`optax" in p or p.startswith("Complete")
    kinds = {p.split("\n")[0] for p in prompts}
    assert "Complete this code:" in kinds and any(k.startswith("Write the Python") for k in kinds)


def test_deterministic_across_a_fresh_parse():
    a = H.code_conversations(40, packages=SMALL)
    H.package_items.cache_clear()
    b = H.code_conversations(40, packages=SMALL)
    assert a == b
    assert H.code_conversations(40, seed=1, packages=SMALL) != a  # the template draw follows the seed


def test_not_in_the_training_corpus():
    convs = H.code_conversations(80, packages=SMALL)
    train_src = {corpora._truncate(src) for _m, _k, _n, src in corpora._code_pairs("train")}
    train_prompts = {c[0]["content"] for c in corpora.code_conversations("train")}
    held_prompts = {c[0]["content"] for c in corpora.code_conversations("heldout")}
    for c in convs:
        assert c[0]["content"] not in train_prompts | held_prompts
    for _mod, _kind, _name, src in H.package_items(SMALL)[:80]:
        assert corpora._truncate(src) not in train_src


def test_drops_copies_of_stdlib_code_and_one_liners(tmp_path, monkeypatch):
    """A vendored stdlib function must not become a 'held-out' prompt."""
    src = next(it[3] for it in corpora._stdlib_items() if it[1] == "function" and src_lines(it[3]) >= 4)
    pkg = tmp_path / "fakepkg_vendor"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "util.py").write_text(src + "\n\ndef fresh_helper(x):\n    y = x + 1\n    return y * 2\n\n"
                                 "def tiny(x): return x\n")
    monkeypatch.setattr(H, "_package_root", lambda p: pkg if p == "fakepkg_vendor" else None)
    items = H.package_items(("fakepkg_vendor",))
    assert [(m, n) for m, _k, n, _s in items] == [("fakepkg_vendor.util", "fresh_helper")]


def src_lines(s: str) -> int:
    return len(s.splitlines())


def test_exclude_prompts_and_versions():
    first = H.code_conversations(5, packages=SMALL)
    skip = {c[0]["content"] for c in first[:2]}
    again = H.code_conversations(5, packages=SMALL, exclude_prompts=skip)
    assert not skip & {c[0]["content"] for c in again} and len(again) == 5
    v = H.source_versions()
    assert set(v) == set(H.PACKAGES) and v["numpy"]


@pytest.mark.parametrize("num", [200])
def test_default_code_set_reaches_num(num):
    sets, groups, info = default_conversations(num)
    code = sets["code"]
    assert len(code) == num and len(math := sets["math"]) == num
    assert len({c[0]["content"] for c in code}) == num
    n_std = info["code"]["stdlib_heldout"]
    assert n_std == len(corpora.code_conversations("heldout")) and n_std < num  # the stdlib alone is short
    assert info["code"]["dependencies"] == num - n_std
    assert groups["code"] == ["stdlib_heldout"] * n_std + ["dependencies"] * (num - n_std)
    assert info["code"]["dependency_packages"] == H.source_versions()
    assert all(_domain(c) == "math" for c in math)
