import re
import sys

import pytest

from dspark_jax.data import corpora as C


def test_build_corpus_deterministic_and_seeded():
    a = C.build_corpus("train", seed=0, n_code=40, n_math=40, n_prose=40)
    b = C.build_corpus("train", seed=0, n_code=40, n_math=40, n_prose=40)
    c = C.build_corpus("train", seed=1, n_code=40, n_math=40, n_prose=40)
    assert C.serialize_corpus(a) == C.serialize_corpus(b)
    assert C.corpus_hash(a) == C.corpus_hash(b)
    assert C.corpus_hash(a) != C.corpus_hash(c)
    assert len(a) == 120
    for conv in a:
        assert [m["role"] for m in conv] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"] for m in conv)
    # same items, different order for another seed (code pool is fixed by the stdlib)
    full0 = C.code_conversations("train", seed=0)
    full1 = C.code_conversations("train", seed=1)
    names0 = sorted(c[0]["content"] for c in C.prose_conversations("train", 0))
    names1 = sorted(c[0]["content"] for c in C.prose_conversations("train", 1))
    assert names0 == names1
    assert [c[0]["content"] for c in full0[:20]] != [c[0]["content"] for c in full1[:20]]
    m = C.corpus_manifest(a, seed=0)
    assert m["python_version"] == sys.version and m["sha256"] == C.corpus_hash(a) and m["count"] == 120


def _mentioned_module(conv):
    m = re.search(r"from module `([\w.]+)`|Explain what `([\w.]+)` does", conv[0]["content"])
    return (m.group(1) or m.group(2)) if m else None


def test_heldout_modules_never_in_train():
    train = C.code_conversations("train", 0) + C.prose_conversations("train", 0)
    held = C.code_conversations("heldout", 0) + C.prose_conversations("heldout", 0)
    assert len(held) > 50 and len(train) > 1000
    held_tops = {C.top_level(_mentioned_module(c)) for c in held if _mentioned_module(c)}
    assert held_tops and held_tops <= set(C.HELDOUT_MODULES)
    assert {"json", "csv", "textwrap"} <= held_tops
    for conv in train:
        mod = _mentioned_module(conv)
        if mod:
            assert C.top_level(mod) not in C.HELDOUT_MODULES, mod
    # by content: no held-out answer text appears as a training answer
    train_answers = {c[1]["content"] for c in train}
    assert not train_answers & {c[1]["content"] for c in held}
    # a known held-out function really is held out
    src = "def dedent(text):"
    assert any(src in c[1]["content"] for c in C.code_conversations("heldout", 0))
    assert not any(c[1]["content"].startswith(src) for c in train)


def test_math_problems_correct_disjoint_unique():
    train = C.math_conversations("train", seed=0, n=300)
    held = C.math_conversations("heldout", seed=0, n=100)
    tq = [c[0]["content"] for c in train]
    hq = [c[0]["content"] for c in held]
    assert len(set(tq)) == 300 and len(set(hq)) == 100
    assert not set(tq) & set(hq)
    assert not set(tq) & {c[0]["content"] for c in C.math_conversations("heldout", seed=5, n=100)}
    n_arith = 0
    for conv in train:
        ans = conv[1]["content"]
        m = re.search(r"The answer is (-?\d+)\.$", ans)
        assert m, ans
        q = re.fullmatch(r"Compute \((\d+) \+ (\d+)\) \* (\d+) - (\d+)\.", conv[0]["content"])
        if q:
            a, b, c, d = map(int, q.groups())
            assert int(m.group(1)) == (a + b) * c - d
            n_arith += 1
        assert len(ans.splitlines()) >= 3  # multi-step
    assert n_arith > 10
    assert C.math_conversations("train", 0, 50) == C.math_conversations("train", 0, 50)
    assert C.math_conversations("train", 0, 50) != C.math_conversations("train", 1, 50)
    with pytest.raises(ValueError):
        C.math_conversations("test", 0, 5)
