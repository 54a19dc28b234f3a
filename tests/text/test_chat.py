import json

import numpy as np
import pytest
from jinja2.exceptions import TemplateError

from dspark_jax.data import corpora as C
from dspark_jax.text.chat import CHATML_TEMPLATE, encode_chat, load_chat_template, render_prompt, render_text
from dspark_jax.text.tokenizer import train_tokenizer

# A realistic Qwen3 chat template (tools branch trimmed to its shape).
QWEN3_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and \
not(message.content.startswith('<tool_response>') and \
message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = \
content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + \
'\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- elif message.role != "system" %}
        {{- raise_exception('Unknown role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

CONV = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Write a function that squares x."},
    {"role": "assistant", "content": "def square(x):\n    return x * x\n"},
    {"role": "user", "content": "Say the word assistant."},
    {"role": "assistant", "content": "assistant"},  # also occurs in every role header
    {"role": "user", "content": "What is 6 * 7?"},
    {"role": "assistant", "content": "6 * 7 = 42.\nThe answer is 42."},
]


@pytest.fixture(scope="module")
def tok():
    corpus = C.build_corpus("train", seed=0, n_code=200, n_math=200, n_prose=200)
    return train_tokenizer([C.conversation_text(c) for c in corpus], vocab_size=1024)


def _masked_runs(tok, ids, mask):
    runs, cur = [], []
    for i, m in zip(ids.tolist(), mask.tolist()):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return [tok.decode(r) for r in runs]


@pytest.mark.parametrize("template", [None, QWEN3_TEMPLATE], ids=["chatml", "qwen3"])
def test_loss_mask_covers_exactly_assistant_tokens(tok, template):
    ids, mask = encode_chat(tok, CONV, template=template)
    assert ids.dtype == np.int32 and mask.dtype == np.bool_ and ids.shape == mask.shape
    text = render_text(CONV, template)
    assert tok.decode(ids) == text  # segmentwise tokenization loses nothing
    expected = [m["content"] + "<|im_end|>" for m in CONV if m["role"] == "assistant"]
    assert _masked_runs(tok, ids, mask) == expected
    # headers and user/system text are never trained on
    unmasked = tok.decode(ids[~mask])
    assert unmasked.count("<|im_start|>assistant\n") == 3
    assert "Write a function" in unmasked and "helpful" in unmasked
    assert tok.token_to_id("<|im_start|>") not in ids[mask].tolist()
    assert int(mask.sum()) == sum(len(tok.encode(e)) for e in expected)


def test_qwen3_think_block_not_masked(tok):
    text = render_text(CONV, QWEN3_TEMPLATE)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n6 * 7" in text
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    ids, mask = encode_chat(tok, CONV, template=QWEN3_TEMPLATE)
    assert "</think>" not in "".join(_masked_runs(tok, ids, mask))
    with pytest.raises(TemplateError, match="Unknown role"):
        render_text([{"role": "robot", "content": "x"}], QWEN3_TEMPLATE)


def test_max_len_and_render_prompt(tok):
    ids, mask = encode_chat(tok, CONV, max_len=10)
    full, fmask = encode_chat(tok, CONV)
    assert len(ids) == 10 and (ids == full[:10]).all() and (mask == fmask[:10]).all()
    p = render_prompt(tok, CONV[:2])
    assert tok.decode(p) == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                             "<|im_start|>user\nWrite a function that squares x.<|im_end|>\n"
                             "<|im_start|>assistant\n")
    # prompt + assistant tokens == training stream prefix: drafter sees what inference sees
    n_prompt = len(p)
    assert full[:n_prompt].tolist() == p and fmask[n_prompt] and not fmask[n_prompt - 1]
    q = render_prompt(tok, CONV[:2], template=QWEN3_TEMPLATE)
    assert tok.decode(q).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert tok.decode(render_prompt(tok, CONV[:2], add_generation_prompt=False)).endswith("<|im_end|>\n")


def test_load_chat_template(tmp_path):
    assert load_chat_template(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_TEMPLATE}))
    assert load_chat_template(tmp_path) == QWEN3_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                      {"name": "default", "template": CHATML_TEMPLATE}]}))
    assert load_chat_template(tmp_path) == CHATML_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ 'jinja file' }}")
    assert load_chat_template(tmp_path) == "{{ 'jinja file' }}"


def test_template_sandboxed(tok):
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(Exception):
        render_text(CONV, evil)
    assert render_text(CONV, "{{ messages[0] | tojson }}") == json.dumps(CONV[0])
