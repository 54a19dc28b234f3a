"""Regeneration with the tiny embedded target: greedy parity, masks, resume, diversity, CLI."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.commands.regenerate import main
from dspark_jax.data.corpora import code_conversations, math_conversations, prose_conversations
from dspark_jax.data.dataset import TokenDataset
from dspark_jax.data.regenerate import distinct_ngram_ratio, prompt_messages, regenerate, template_tail
from dspark_jax.decoding.sampling import SamplingParams

MAX_NEW, MAX_PROMPT = 24, 64
# Floor on the mean per-sample distinct-4-gram ratio of sampled regenerations (docs/embedded_target.md).
DISTINCT4_FLOOR = 0.6


@pytest.fixture(scope="module")
def tiny(embedded_tiny_dir):
    """The tiny embedded target, built once per cache (see docs/embedded_target.md)."""
    from dspark_jax.io.hf import load_target

    return load_target(embedded_tiny_dir)


@pytest.fixture(scope="module")
def prompts():
    return (math_conversations("heldout", 0, 3) + code_conversations("heldout", 0, 2)
            + prose_conversations("heldout", 0, 2))


@pytest.fixture(scope="module")
def sampled(tiny, prompts, tmp_path_factory):
    """An uninterrupted sampled run (reference settings) of all prompts, batch 3."""
    out = tmp_path_factory.mktemp("regen") / "full"
    stats = regenerate(tiny, prompts, out, batch_size=3, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT,
                       seed=7, progress=False, verbose=False)
    return out, stats


def _argmax_reference(model, prompt, stop_ids):
    """Greedy tokens from a full causal forward of the whole prefix at every step (no cache)."""
    graphdef, state = nnx.split(model)
    buf_len = MAX_PROMPT + MAX_NEW
    fn = _argmax_reference.__dict__.setdefault("fn", jax.jit(
        lambda st, buf, cur: jnp.argmax(nnx.merge(graphdef, st)(buf).logits[0, cur - 1])))
    buf = np.zeros((1, buf_len), np.int32)
    buf[0, :len(prompt)] = prompt
    cur, out = len(prompt), []
    for _ in range(MAX_NEW):
        t = int(fn(state, buf, cur))
        out.append(t)
        buf[0, cur] = t
        cur += 1
        if t in stop_ids:
            break
    return out


def test_greedy_regeneration_equals_no_cache_argmax(tiny, prompts, tmp_path):
    from dspark_jax.text.chat import render_prompt

    tok = tiny.tokenizer
    out = tmp_path / "greedy"
    regenerate(tiny, prompts[:3], out, batch_size=2, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT,
               sampling=SamplingParams(0.0, 0, 1.0), progress=False, verbose=False)
    ds = TokenDataset(out)
    assert len(ds) == 3
    tail = tok.encode(template_tail(tiny.chat_template))
    for i in range(3):
        rec = ds[i]
        prompt = render_prompt(tok, prompt_messages(prompts[i]), tiny.chat_template)
        ref = _argmax_reference(tiny.model, prompt, tok.stop_ids)
        n = len(prompt)
        np.testing.assert_array_equal(rec["tokens"][:n], prompt)
        np.testing.assert_array_equal(rec["tokens"][n:n + len(ref)], ref)
        assert not rec["loss_mask"][:n].any() and rec["loss_mask"][n:n + len(ref)].all()
        assert not rec["loss_mask"][n + len(ref):].any()
        rest = list(rec["tokens"][n + len(ref):])
        # stopped: template tail only; cut at max_new_tokens: unmasked end-of-turn + tail
        assert rest == (tail if ref[-1] in tok.stop_ids else [tok.eos_id] + tail)
        assert len(ref) <= MAX_NEW


def test_interrupted_and_resumed_equals_uninterrupted(tiny, prompts, sampled, tmp_path):
    full, _ = sampled
    out = tmp_path / "resumed"

    def stop_after_4(i, tokens, mask):
        if i == 3:  # mid-batch (batches of 3: [0,1,2], [3,4,5], [6])
            raise KeyboardInterrupt

    kw = dict(batch_size=3, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT, seed=7, progress=False, verbose=False)
    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny, prompts, out, on_record=stop_after_4, **kw)
    assert not out.exists() and out.with_name(out.name + ".partial").exists()
    seen = []
    regenerate(tiny, prompts, out, resume=True, on_record=lambda i, t, m: seen.append(i), **kw)
    assert seen == [4, 5, 6]
    a, b = TokenDataset(full), TokenDataset(out)
    assert len(a) == len(b) == len(prompts)
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i]["tokens"], b[i]["tokens"])
        np.testing.assert_array_equal(a[i]["loss_mask"], b[i]["loss_mask"])


def test_resume_refuses_other_settings(tiny, prompts, tmp_path):
    out = tmp_path / "r"

    def boom(i, t, m):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regenerate(tiny, prompts, out, batch_size=2, max_new_tokens=4, max_prompt_len=MAX_PROMPT, seed=1,
                   progress=False, verbose=False, on_record=boom)
    with pytest.raises(ValueError, match="seed"):
        regenerate(tiny, prompts, out, batch_size=2, max_new_tokens=4, max_prompt_len=MAX_PROMPT, seed=2,
                   resume=True, progress=False, verbose=False)
    # a dataset whose meta.json lacks a setting is refused by name, not resumed under a guessed default
    meta = out.with_name(out.name + ".partial") / "meta.partial.json"
    m = json.loads(meta.read_text())
    del m["info"]["regenerate"]["thinking"]
    meta.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"records no \['thinking'\].*--overwrite"):
        regenerate(tiny, prompts, out, batch_size=2, max_new_tokens=4, max_prompt_len=MAX_PROMPT, seed=1,
                   resume=True, progress=False, verbose=False)


def test_sampled_text_is_not_degenerate(sampled):
    full, stats = sampled
    ds = TokenDataset(full)
    gens = [r["tokens"][r["loss_mask"]] for r in (ds[i] for i in range(len(ds)))]
    ratios = [distinct_ngram_ratio([g]) for g in gens if len(g) >= 8]
    assert ratios and float(np.mean(ratios)) > DISTINCT4_FLOOR
    assert stats["generated_tokens"] == sum(len(g) for g in gens)
    assert distinct_ngram_ratio([[1, 2, 3, 4] * 10]) < 0.2  # the metric catches loops


def test_cli_writes_dataset_from_turns_jsonl(tiny, tmp_path, dspark_caplog):
    p = tmp_path / "prompts.jsonl"
    p.write_text("\n".join(json.dumps({"turns": [t]}) for t in ("What is 2 + 3?", "Write a loop.")) + "\n")
    out = tmp_path / "cli"
    main(["--target", str(tiny.path), "--prompts", str(p), "--out", str(out), "--num-prompts", "2", "--batch", "2",
          "--max-new-tokens", "4", "--max-prompt-len", str(MAX_PROMPT), "--no-progress"])
    assert "tokens/s" in dspark_caplog.text  # the summary line, logged by data/regenerate.py
    ds = TokenDataset(out)
    assert len(ds) == 2 and ds.meta["info"]["regenerate"]["top_k"] == 20
    assert all(1 <= ds[i]["loss_mask"].sum() <= 4 for i in range(2))


def test_bad_num_is_named(tiny, prompts, tmp_path):
    with pytest.raises(ValueError, match="--num-prompts"):
        regenerate(tiny, prompts, tmp_path / "x", num=len(prompts) + 1, progress=False, verbose=False)


def test_every_turn_is_regenerated_on_the_regenerated_history(tiny, tmp_path):
    """Greedy, two chats of 2 and 3 turns: turn k's prompt holds the target's earlier answers (not
    the chat's own), each answer equals the no-cache argmax from that prompt, and the record is the
    last prompt + its answer with every regenerated answer masked (cut answers' end-of-turn not)."""
    from dspark_jax.data.multiturn import encode_conversation, history_answer

    tok = tiny.tokenizer
    chats = [[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "ORIGINAL ANSWER"},
              {"role": "user", "content": "4+4?"}],
             [{"role": "user", "content": "Hi."}, {"role": "user", "content": "Bye."},
              {"role": "user", "content": "Ok?"}]]
    out = tmp_path / "multi"
    stats = regenerate(tiny, chats, out, batch_size=2, max_new_tokens=8, max_prompt_len=MAX_PROMPT,
                       sampling=SamplingParams(0.0, 0, 1.0), progress=False, verbose=False)
    assert stats["turns"] == 5 and stats["records"] == 2
    ds = TokenDataset(out)
    tail = tok.encode(template_tail(tiny.chat_template))
    for c, chat in enumerate(chats):
        users = [m for m in chat if m["role"] == "user"]
        history, cut = [], set()
        for k, u in enumerate(users):
            ids, mask = encode_conversation(tok, history + [u], tiny.chat_template, frozenset(cut), True)
            assert len(ids) <= MAX_PROMPT
            ref = _argmax_reference(tiny.model, ids, tok.stop_ids)[:8]
            ended = ref[-1] in tok.stop_ids
            if k < len(users) - 1:
                history = history + [u, {"role": "assistant",
                                         "content": history_answer(tok.decode(ref[:-1] if ended else ref))}]
                if not ended:
                    cut.add(len(history) - 1)
        rest = tail if ended else [tok.eos_id] + tail
        np.testing.assert_array_equal(ds[c]["tokens"], ids + ref + rest)
        np.testing.assert_array_equal(ds[c]["loss_mask"], mask + [True] * len(ref) + [False] * len(rest))
        assert "ORIGINAL" not in tok.decode(ds[c]["tokens"].tolist())
        assert sum(mask) > 0  # the earlier regenerated answers are trained on too
