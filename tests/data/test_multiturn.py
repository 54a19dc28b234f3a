"""Turns of a chat to regenerate, and the (ids, loss mask) of a chat with cut answers."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.data.multiturn import encode_conversation, history_answer, left_truncate, turn_prompts
from dspark_jax.text.chat import END_OF_TURN, encode_chat


def _u(c):
    return {"role": "user", "content": c}


def _a(c):
    return {"role": "assistant", "content": c}


def test_turn_prompts_one_per_user_message_answers_dropped():
    sys_ = {"role": "system", "content": "be brief"}
    assert turn_prompts([sys_, _u("q1"), _a("old"), _u("q2")]) == [[sys_, _u("q1")], [_u("q2")]]
    assert turn_prompts([_u("q1"), _u("q2")]) == [[_u("q1")], [_u("q2")]]  # {"turns": [q1, q2]}
    assert turn_prompts([_u("q1"), _a("a1")]) == [[_u("q1")]]
    with pytest.raises(ValueError, match="starts with an assistant"):
        turn_prompts([_a("hi"), _u("q")])


def test_history_answer_drops_the_reasoning_block():
    assert history_answer("<think>\nhmm\n</think>\n\nFive.") == "Five."
    assert history_answer("Five.") == "Five."


@pytest.fixture(scope="module")
def tok(embedded_tiny_dir):
    from dspark_jax.text.tokenizer import Tokenizer

    return Tokenizer.load(embedded_tiny_dir)


def test_without_cuts_it_is_encode_chat(tok):
    msgs = [_u("What is 2 + 3?"), _a("It is 5."), _u("And 4 + 4?"), _a("8.")]
    ids, mask = encode_conversation(tok, msgs)
    ref_ids, ref_mask = encode_chat(tok, msgs)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)


def test_a_cut_answer_keeps_its_end_of_turn_out_of_the_mask(tok):
    msgs = [_u("What is 2 + 3?"), _a("It is 5 and"), _u("And 4 + 4?"), _a("8.")]
    ids, mask = encode_conversation(tok, msgs, cut=frozenset({1}))
    ids, mask = np.asarray(ids), np.asarray(mask)
    eot = tok.token_to_id(END_OF_TURN)
    trained = tok.decode(ids[mask].tolist())
    assert trained == "It is 5 and" + "8." + END_OF_TURN  # the cut answer's end-of-turn is not trained on
    at = int(np.flatnonzero(ids == eot)[1])  # end of turn after the first answer (the first closes the user turn)
    assert not mask[at] and mask[at - 1]
    _, full_mask = encode_conversation(tok, msgs)
    assert full_mask[at] and np.sum(full_mask) == np.sum(mask) + 1


def test_generation_prompt_ends_with_the_assistant_header(tok):
    msgs = [_u("q1"), _a("a1"), _u("q2")]
    ids, mask = encode_conversation(tok, msgs, add_generation_prompt=True)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "a1" + END_OF_TURN
    ids2, mask2, cut = left_truncate(ids, mask, 5)
    assert cut and ids2 == ids[-5:] and mask2 == mask[-5:]
