"""What the server accepts and refuses, and that one request cannot hurt the others: a live
server on 127.0.0.1 (tiny embedded target, target-only, 4 slots), raw HTTP. Failures are
injected into one request's path (its join, its rounds' bookkeeping) and into the engine; the
other requests must still get their exact greedy text."""

from __future__ import annotations

import dataclasses
import gc
import http.client
import itertools
import json
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (pip install -e .[serve])")

from tests.serve.helpers import (
    JSON,
    PROMPTS,
    call,
    in_thread,
    is_error_body,
    metric,
    post,
    rss_bytes,
    start,
    stop,
    wait_until,
)


@pytest.fixture(scope="module")
def srv(embedded_tiny_dir):
    """The server, built with warm-up held back by a gate: /health and a request are observed
    while it starts; then the greedy answers to PROMPTS (12 tokens) are recorded."""
    from dspark_jax.serve.loop import EngineLoop

    gate, real_warm = threading.Event(), EngineLoop._warm

    def gated(self, *args):
        gate.wait(300)
        return real_warm(self, *args)

    seen = {}
    EngineLoop._warm = gated
    try:
        served, server, thread, port = start(embedded_tiny_dir, None, warmup=True)
        model = served.model
        status, _, body = call(port, "/health")
        seen["starting"] = (status, json.loads(body))
        early, early_out = in_thread(post, port, "/v1/completions",
                                     {"model": model, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0})
        time.sleep(0.5)
        seen["answered_while_starting"] = bool(early_out)
        gate.set()
    finally:
        EngineLoop._warm = real_warm
    try:
        assert wait_until(lambda: call(port, "/health")[0] == 200, 300), "the warm-up did not finish"
        eng = served.loop.engine
        seen["compiled"] = (eng.compiled_rounds(), eng._prefill._cache_size())
        early.join(120)
        seen["early"] = early_out[0]

        def greedy(p):
            return post(port, "/v1/completions", {"model": model, "prompt": p, "max_tokens": 12, "temperature": 0})

        with ThreadPoolExecutor(8) as ex:
            answers = list(ex.map(greedy, PROMPTS))
        assert all(s == 200 for s, _ in answers), answers
        texts = [b["choices"][0]["text"] for _, b in answers]
        yield SimpleNamespace(served=served, port=port, model=model, texts=texts, seen=seen, app=server.config.app)
    finally:
        gate.set()
        stop(server, thread, served)


_LONG: list[str] = []
EXTRA_PROMPTS = ("Write a long story about a robot.", "1, 2, 3, 4, 5,", "def main():\n    ", "The numbers are")


def long_prompt(srv) -> str:
    """A prompt whose greedy answer runs a whole 100-token budget. Which one depends on the embedded
    target, which each machine trains anew with its own Python and JAX (docs/embedded_target.md)."""
    if not _LONG:
        for p in (*PROMPTS, *EXTRA_PROMPTS):
            if complete(srv, p, max_tokens=100)[1]["choices"][0]["finish_reason"] == "length":
                _LONG.append(p)
                break
        else:
            raise AssertionError("no prompt's greedy answer runs 100 tokens on this embedded target: add one")
    return _LONG[0]


def complete(srv, prompt, port=None, **kw):
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}
    return post(port or srv.port, "/v1/completions", body)


def all_greedy_exact(srv, port=None) -> bool:
    with ThreadPoolExecutor(8) as ex:
        got = list(ex.map(lambda p: complete(srv, p, port), PROMPTS))
    return [b["choices"][0]["text"] if s == 200 else (s, b) for s, b in got] == srv.texts


# ---------------------------------------------------------------------- starting

def test_health_says_starting_until_the_programs_are_compiled(srv):
    status, body = srv.seen["starting"]
    assert status == 503 and body["status"] == "starting"
    assert not srv.seen["answered_while_starting"]  # it waited for the warm-up, then was served
    assert srv.seen["early"][0] == 200 and srv.seen["early"][1]["choices"][0]["text"] == srv.texts[0]
    eng = srv.served.loop.engine
    rounds, prefills = srv.seen["compiled"]
    assert rounds == 1 and prefills == len(eng.prefill_buckets)  # every bucket compiled before "ok"
    assert (eng.compiled_rounds(), eng._prefill._cache_size()) == (rounds, prefills)  # traffic compiled nothing new


# ---------------------------------------------------------------------- isolation

def test_values_beyond_the_engines_ranges_never_reach_its_thread(srv):
    """top_k >= 2^31 overflowed the engine's int32 controls inside its thread: now clamped to the
    vocabulary on the way in; what the engine cannot represent is refused before its queue."""
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.serve.loop import InvalidRequest, Request

    loop = srv.served.loop
    for top_k in (2 ** 31, 2 ** 63, 10 ** 30):
        status, body = complete(srv, PROMPTS[1], top_k=top_k)
        assert status == 200 and body["choices"][0]["text"] == srv.texts[1]
    bad = [("sampling", SamplingParams(float("nan"), 0, 1.0)), ("sampling", SamplingParams(1.0, 0, float("inf"))),
           ("sampling", SamplingParams(1e39, 0, 1.0)), ("sampling", SamplingParams(1.0, 1.5, 1.0)),
           ("prompt", [1, loop.vocab_size]), ("prompt", []), ("max_new", 0), ("max_new", 2 ** 40),
           ("stop_ids", (2 ** 31,)), ("seed", 1.5)]
    for name, v in bad:
        args = {"prompt": [1, 2, 3], "max_new": 4, "sampling": SamplingParams(1.0, 0, 1.0), name: v}
        with pytest.raises(InvalidRequest):
            loop.submit(Request(**args))
    req = loop.check(Request([1, 2, 3], 4, SamplingParams(0.5, 2 ** 31, 1.0)))
    assert req.sampling.top_k == loop.vocab_size
    assert call(srv.port, "/health")[0] == 200
    assert all_greedy_exact(srv)


def test_a_failure_in_one_requests_path_fails_only_that_request(srv, monkeypatch):
    """Injected: a join that raises for one prompt (before touching the decode state), then a
    failure in one request's per-round bookkeeping mid-stream. That request gets a 500 (or an
    error event); the seven others, in flight at the same time, get their exact greedy text."""
    served, loop, eng = srv.served, srv.served.loop, srv.served.loop.engine
    poison = "Poison pill, please fail"
    poison_ids = served.tokenizer.encode(poison)
    real_start, real_advance = eng.start, loop._advance

    def start(st, ctl, slots, prompts, *rest):
        if any(list(p) == poison_ids for p in prompts):
            raise RuntimeError("injected join failure")
        return real_start(st, ctl, slots, prompts, *rest)

    def advance(req, s, *rest):
        if req.prompt == poison_ids and req.tokens:
            raise RuntimeError("injected bookkeeping failure")
        return real_advance(req, s, *rest)

    def streamed_poison():
        status, _, text = call(srv.port, "/v1/completions", {"model": srv.model, "prompt": poison, "max_tokens": 30,
                                                             "temperature": 0, "stream": True})
        return status, text

    errors0, e500 = metric(srv.port, "dspark_request_errors_total"), \
        metric(srv.port, 'dspark_requests_total{endpoint="completions",status="500"}')
    for patch, victim in ((("start", start), lambda: complete(srv, poison)), (("_advance", advance), streamed_poison)):
        obj = eng if patch[0] == "start" else loop
        monkeypatch.setattr(obj, *patch)
        with ThreadPoolExecutor(8) as ex:
            bad = ex.submit(victim)
            good = list(ex.map(lambda p: complete(srv, p), PROMPTS[1:]))
        monkeypatch.undo()
        assert [b["choices"][0]["text"] for _, b in good] == srv.texts[1:]
        status, body = bad.result()
        if patch[0] == "start":
            assert status == 500 and is_error_body(body) and "injected join failure" in body["error"]["message"]
        else:  # the stream began (200), then one error event and [DONE]
            events = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
            assert status == 200 and "injected bookkeeping failure" in events[-1]["error"]["message"]
            assert body.rstrip().endswith("data: [DONE]")
    assert metric(srv.port, "dspark_request_errors_total") == errors0 + 2
    assert metric(srv.port, 'dspark_requests_total{endpoint="completions",status="500"}') == e500 + 2
    assert call(srv.port, "/health")[0] == 200 and loop.slots_in_use == 0
    assert all_greedy_exact(srv)


def test_an_engine_failure_fails_the_requests_in_flight_and_the_loop_starts_afresh(srv, monkeypatch):
    """Injected: a join whose compiled call consumed the decode state and then raised. The
    requests in flight end with an error (their state is gone), the loop rebuilds its state
    and serves the next requests exactly."""
    import jax

    served, eng = srv.served, srv.served.loop.engine
    long = long_prompt(srv)
    poison = "Poison pill, break the engine"
    poison_ids = served.tokenizer.encode(poison)
    real_start = eng.start

    def start(st, ctl, slots, prompts, *rest):
        out = real_start(st, ctl, slots, prompts, *rest)
        if any(list(p) == poison_ids for p in prompts):
            for x in jax.tree.leaves(st):  # as a donated input is
                if not x.is_deleted():
                    x.delete()
            raise RuntimeError("injected device failure")
        return out

    real_step = eng.step

    def slow_step(st, ctl):  # 100 tokens take >= 2 s: the long request is still running when the poison joins
        time.sleep(0.02)
        return real_step(st, ctl)

    monkeypatch.setattr(eng, "start", start)
    monkeypatch.setattr(eng, "step", slow_step)
    long_th, long_out = in_thread(call, srv.port, "/v1/completions",
                                  {"model": srv.model, "prompt": long, "max_tokens": 100, "temperature": 0,
                                   "stream": True})
    assert wait_until(lambda: served.loop.slots_in_use == 1, 60)
    status, body = complete(srv, poison)
    long_th.join(60)
    monkeypatch.undo()
    assert status == 500 and "injected device failure" in body["error"]["message"]
    assert "injected device failure" in long_out[0][2] and long_out[0][2].rstrip().endswith("data: [DONE]")
    assert call(srv.port, "/health")[0] == 200
    assert all_greedy_exact(srv)


# ---------------------------------------------------------------------- the request schema

COMPLETION_CASES = [  # (changes to a valid completion request, status, the field a 400 names)
    ({"stream": "false"}, 400, "stream"),
    ({"stream": True, "stream_options": "yes"}, 400, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
    ({"logprobs": 1}, 400, "logprobs"),
    ({"logprobs": 0}, 400, "logprobs"),
    ({"logit_bias": {"1": 5}}, 400, "logit_bias"),
    ({"frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"presence_penalty": -1}, 400, "presence_penalty"),
    ({"repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ({"echo": True}, 400, "echo"),
    ({"best_of": 2}, 400, "best_of"),
    ({"suffix": "end"}, 400, "suffix"),
    ({"n": 2}, 400, "n"),
    ({"temperature": 1e308}, 400, "temperature"),
    ({"temperature": -0.5}, 400, "temperature"),
    ({"temperature": "0.5"}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1e308}, 400, "top_p"),
    ({"top_k": -2}, 400, "top_k"),
    ({"seed": 2 ** 70}, 400, "seed"),
    ({"seed": 2 ** 63}, 400, "seed"),
    ({"seed": -(2 ** 63) - 1}, 400, "seed"),
    ({"seed": 1.0}, 400, "seed"),
    ({"seed": -(2 ** 63)}, 200, None),
    ({"max_tokens": 4.0}, 400, "max_tokens"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [1, 2, 10 ** 9]}, 400, "prompt"),
    ({"prompt": {"text": "hi"}}, 400, "prompt"),
    ({"stop": ["a"] * 5}, 400, "stop"),
    ({"stop": [""]}, 400, "stop"),
    ({"model": 5}, 400, "model"),
    ({"model": "gpt-4"}, 400, "model"),
    ({"foo": 1}, 400, "foo"),
    ({"tools": []}, 400, "tools"),
    ({"frequency_penalty": 0, "presence_penalty": 0.0, "logprobs": None, "n": 1, "user": "u", "logit_bias": {},
      "best_of": 1, "echo": False, "stream": None, "seed": 2 ** 63 - 1}, 200, None),
    ({"stream": False, "stream_options": {"include_usage": True}}, 200, None),
    ({"prompt": ["Once upon a time"], "stop": "\n\n\n"}, 200, None),
    ({"prompt": [1, 2, 3]}, 200, None),
]

CHAT_CASES = [
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "function", "content": "x", "name": "f"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}]},
     400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]}, 400, "messages[0].tool_call_id"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]}, 400, "messages[0]"),
    ({"messages": []}, 400, "messages"),
    ({"messages": "hello"}, 400, "messages"),
    ({"messages": ["hello"]}, 400, "messages[0]"),
    ({"logprobs": True}, 400, "logprobs"),
    ({"top_logprobs": 3}, 400, "top_logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"tool_choice": "auto"}, 400, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"chat_template_kwargs": {"messages": 1}}, 400, "chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, 400, "chat_template_kwargs"),
    ({"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"stream": "true"}, 400, "stream"),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                   {"role": "assistant", "content": None}, {"role": "user", "content": "More"}]}, 200, None),
    ({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "bob"}]},
     200, None),
    ({"logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
      "parallel_tool_calls": False}, 200, None),
]


@pytest.mark.parametrize("chat,change,status,param",
                         [(False, *c) for c in COMPLETION_CASES] + [(True, *c) for c in CHAT_CASES],
                         ids=[f"completion-{i}" for i in range(len(COMPLETION_CASES))]
                         + [f"chat-{i}" for i in range(len(CHAT_CASES))])
def test_request_fields_are_typed_and_refusals_name_the_field(srv, chat, change, status, param):
    if chat:
        body = {"model": srv.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    else:
        body = {"model": srv.model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0}
    body.update(change)
    got, answer = post(srv.port, "/v1/chat/completions" if chat else "/v1/completions", body)
    assert got == status, answer
    if status == 400:
        assert is_error_body(answer) and answer["error"]["param"] == param, answer
        assert param.split(".")[0].split("[")[0] in answer["error"]["message"]
    else:
        assert answer["choices"][0]["finish_reason"] in ("length", "stop")


def test_text_parts_are_joined_and_images_refused_by_name(srv):
    def chat(content):
        return post(srv.port, "/v1/chat/completions", {"model": srv.model, "max_tokens": 8, "temperature": 0,
                                                        "messages": [{"role": "user", "content": content}]})

    parts = chat([{"type": "text", "text": "Tell me"}, {"type": "text", "text": "a story"}])
    joined = chat("Tell me\na story")
    assert parts[0] == joined[0] == 200
    assert parts[1]["choices"][0]["message"]["content"] == joined[1]["choices"][0]["message"]["content"]
    status, body = chat([{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "x"}}])
    assert status == 400 and "image_url" in body["error"]["message"] and "text parts only" in body["error"]["message"]


def test_bodies_that_are_not_strict_json_objects_are_400s_and_counted(srv):
    m = json.dumps(srv.model).encode()
    raw = [b'{"model": ' + m + b', "prompt": "x", "temperature": NaN}',
           b'{"model": ' + m + b', "prompt": "x", "temperature": Infinity}',
           b'{"model": ' + m + b', "prompt": "x", "top_p": -Infinity}',
           b'{"model": ' + m + b', "prompt": "x", "temperature": 1e999}',
           b'{"model": ' + m + b', "prompt": "x", "seed": 1' + b"0" * 5000 + b"}",
           b"[" * 100_000 + b"]" * 100_000,
           b'{"model": ' + m + b', "prompt": "x", "chat_template_kwargs": ' + b'{"a": ' * 40 + b"1" + b"}" * 41,
           b'"just a string"', b"[1, 2]", b"null", b"", b"{not json", b"\xff\xfe\x00garbage",
           b'{"model": ' + m + b', "prompt": "x", "stream_options": [1]}']
    c400 = metric(srv.port, 'dspark_requests_total{endpoint="completions",status="400"}')
    c500 = metric(srv.port, 'dspark_requests_total{endpoint="completions",status="500"}')
    for body in raw:
        status, answer = post(srv.port, "/v1/completions", body)
        assert status == 400 and is_error_body(answer), (body[:60], status, answer)
    assert metric(srv.port, 'dspark_requests_total{endpoint="completions",status="400"}') == c400 + len(raw)
    assert metric(srv.port, 'dspark_requests_total{endpoint="completions",status="500"}') == c500


# ---------------------------------------------------------------------- seeds, ids, usage, HEAD

def _sampled(srv, monkeypatch, job_ids=None, **kw):
    """(text, response id) of a temperature-1 completion; `job_ids`: the engine's request numbers
    start there (as in a freshly started process)."""
    if job_ids is not None:
        from dspark_jax.engine import batcher

        monkeypatch.setattr(batcher, "_ids", itertools.count(job_ids))
    status, body = complete(srv, PROMPTS[4], max_tokens=12, temperature=1.0, **kw)
    assert status == 200, body
    return body["choices"][0]["text"], body["id"]


def test_seeds_use_all_64_bits_and_unseeded_requests_draw_fresh_ones(srv, monkeypatch):
    """A seed is honoured in full (42 and 42 + 2^32 sample differently, the same seed alike, a
    negative one too); beyond the signed 64-bit range a 400 names it. Without a seed, requests
    numbered alike (as after every restart) still sample differently and get distinct ids of
    the form cmpl-<32 hex>."""
    same = {_sampled(srv, monkeypatch, seed=42)[0] for _ in range(2)}
    assert len(same) == 1
    assert _sampled(srv, monkeypatch, seed=42 + 2 ** 32)[0] not in same
    assert _sampled(srv, monkeypatch, seed=-42)[0] == _sampled(srv, monkeypatch, seed=-42)[0]
    assert _sampled(srv, monkeypatch, seed=-42)[0] not in same
    status, body = complete(srv, PROMPTS[4], seed=2 ** 63)
    assert status == 400 and body["error"]["param"] == "seed" and "64-bit" in body["error"]["message"]
    assert str(2 ** 63 - 1) in body["error"]["message"]

    unseeded = [_sampled(srv, monkeypatch, job_ids=1000) for _ in range(3)]
    assert len({t for t, _ in unseeded}) > 1, unseeded
    ids = [i for _, i in unseeded]
    assert len(set(ids)) == 3 and all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids), ids
    status, body = post(srv.port, "/v1/chat/completions", {"model": srv.model, "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "Hi"}]})
    assert status == 200 and re.fullmatch(r"chatcmpl-[0-9a-f]{32}", body["id"]), body


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stream_usage_only_when_asked_for_and_then_once(srv, chat):
    """OpenAI's semantics: no "usage" in a stream without stream_options.include_usage; with it,
    "usage" null on every chunk and one last chunk with no choices carrying the totals."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": srv.model, "max_tokens": 6, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "Hi"}]} if chat else {"prompt": PROMPTS[0]})
    status, whole = post(srv.port, path, body)
    assert status == 200
    status, _, plain = call(srv.port, path, {**body, "stream": True})
    assert status == 200 and plain.rstrip().endswith("data: [DONE]")
    assert not any("usage" in e for e in _events(plain)), plain
    for options in ({"include_usage": False}, {"include_usage": None}):
        status, _, text = call(srv.port, path, {**body, "stream": True, "stream_options": options})
        assert status == 200 and not any("usage" in e for e in _events(text)), text
    status, _, text = call(srv.port, path, {**body, "stream": True, "stream_options": {"include_usage": True}})
    events = _events(text)
    assert status == 200 and text.rstrip().endswith("data: [DONE]")
    assert [e["usage"] is not None for e in events] == [False] * (len(events) - 1) + [True], text
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_head_is_answered_where_get_is(srv):
    for path in ("/health", "/v1/models", "/metrics"):
        status, _, body = call(srv.port, path, method="HEAD")
        assert status == 200 and body == "", (path, status)
        assert call(srv.port, path)[0] == 200
    assert call(srv.port, "/v1/completions", method="HEAD")[0] == 405


# ---------------------------------------------------------------------- clients that leave

def test_clients_that_leave_free_their_slots_within_a_round(srv, monkeypatch):
    """Eight non-streamed clients time out (and two streamed ones hang up) long before their
    max_tokens: every slot and the queue are free again within a round or so, each counted as
    499. Rounds are slowed to 20 ms so that the 100 tokens would take >= 2 s per request."""
    loop, eng = srv.served.loop, srv.served.loop.engine
    prompt = long_prompt(srv)  # its greedy answer runs the whole budget
    real_step = eng.step

    def slow_step(st, ctl):
        time.sleep(0.02)
        return real_step(st, ctl)

    monkeypatch.setattr(eng, "step", slow_step)
    gone0 = metric(srv.port, 'dspark_requests_total{endpoint="completions",status="499"}')
    rounds0 = loop.rounds
    body = {"model": srv.model, "prompt": prompt, "max_tokens": 100, "temperature": 0}

    def impatient(_):
        try:
            call(srv.port, "/v1/completions", body, timeout=0.4)
        except TimeoutError:
            return "timed out"
        return "answered"

    def hang_up(_):
        conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                      {"Content-Type": "application/json"})
        r = conn.getresponse()
        r.fp.readline()  # the first event
        conn.close()
        return "hung up"

    t0 = time.monotonic()
    with ThreadPoolExecutor(10) as ex:
        got = list(ex.map(impatient, range(8))) + list(ex.map(hang_up, range(2)))
    assert got == ["timed out"] * 8 + ["hung up"] * 2
    assert wait_until(lambda: loop.slots_in_use == 0 and loop.queue_depth == 0, 1.0)
    freed = time.monotonic() - t0
    print(f"[leave] slots and queue free {freed:.2f} s after the ten clients started, {loop.rounds - rounds0} rounds")
    assert freed < 2.0 and loop.rounds - rounds0 < 100, (freed, loop.rounds - rounds0)
    assert wait_until(lambda: metric(srv.port, 'dspark_requests_total{endpoint="completions",status="499"}')
                      == gone0 + 10, 5)


# ---------------------------------------------------------------------- access

def test_api_key_cors_and_docs_are_off_unless_asked_for(srv):
    from dspark_jax.serve import serve_in_thread
    from dspark_jax.serve.app import make_app
    from dspark_jax.serve.served import Access

    port, m = srv.port, srv.model
    for path in ("/docs", "/redoc", "/openapi.json"):
        status, _, body = call(port, path)
        assert status == 404 and is_error_body(json.loads(body))
    ok = {"model": m, "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None):
        headers = {"Content-Type": ctype} if ctype else {"Content-Type": ""}
        status, _, body = call(port, "/v1/completions", json.dumps(ok).encode(), headers=headers)
        assert status == 415 and is_error_body(json.loads(body)), ctype
    pre = {"Origin": "http://site.example", "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "content-type"}
    status, headers, _ = call(port, "/v1/completions", headers=pre, method="OPTIONS")
    assert "access-control-allow-origin" not in headers
    assert "access-control-allow-origin" not in call(port, "/v1/models", headers={"Origin": "http://site.example"})[1]

    app = make_app(srv.served, Access(api_key="sekret", cors_origins=("http://ok.example",), docs=True),
                   owns_loop=False)
    server, thread, kport = serve_in_thread(app)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                        {"Authorization": "Basic sekret"}):
            status, hdrs, body = call(kport, "/v1/models", headers=headers)
            assert status == 401 and is_error_body(json.loads(body)) and hdrs["www-authenticate"] == "Bearer"
            assert call(kport, "/v1/completions", ok, headers=headers)[0] == 401
            assert call(kport, "/v1/chat/completions", ok, headers=headers)[0] == 401
        key = {"Authorization": "Bearer sekret"}
        assert call(kport, "/v1/models", headers=key)[0] == 200
        status, answer = post(kport, "/v1/completions", ok, headers=key)
        assert status == 200 and answer["choices"][0]["text"] == srv.texts[0]
        assert call(kport, "/health")[0] == 200  # no key needed outside /v1
        status, headers, _ = call(kport, "/v1/completions", headers={**pre, "Origin": "http://ok.example"},
                                  method="OPTIONS")
        assert status == 200 and headers["access-control-allow-origin"] == "http://ok.example"
        status, headers, _ = call(kport, "/v1/completions", headers=pre, method="OPTIONS")
        assert status == 400 and "access-control-allow-origin" not in headers
        # the official JS client's preflight asks for its own headers too: all are admitted
        asked = ["authorization", "content-type", "x-stainless-arch", "x-stainless-lang", "x-stainless-os",
                 "x-stainless-package-version", "x-stainless-retry-count", "x-stainless-runtime",
                 "x-stainless-runtime-version", "x-stainless-timeout", "openai-organization", "openai-project"]
        status, headers, _ = call(kport, "/v1/chat/completions", method="OPTIONS", headers={
            "Origin": "http://ok.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": ", ".join(asked)})
        allowed = {h.strip().lower() for h in headers.get("access-control-allow-headers", "").split(",")}
        assert status == 200 and set(asked) <= allowed, (status, headers)
        assert call(kport, "/docs")[0] == 200 and json.loads(call(kport, "/openapi.json")[2])["openapi"]
    finally:
        server.should_exit = True
        thread.join(30)
    assert srv.served.loop.error is None and call(port, "/health")[0] == 200


# ---------------------------------------------------------------------- limits

def _declared_but_not_sent(port, declared: int, sent: int = 4096):
    """POST a body declared as `declared` bytes, send only `sent` of them, read the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(declared))
        conn.endheaders()
        conn.send(b"{" + b" " * (sent - 1))
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def _chunked(port, total: int, chunk: int = 1 << 20):
    """POST `total` bytes in chunks, no Content-Length (the last chunk is what crosses a limit)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        sent = 0
        while sent < total:
            n = min(chunk, total - sent)
            conn.send(b"%x\r\n" % n + b" " * n + b"\r\n")
            sent += n
        conn.send(b"0\r\n\r\n")
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def test_large_bodies_are_refused_early_and_leave_memory_as_it_was(srv):
    """Ten large requests (five declared at 20 MB, five of 3.5 MB whose prompt exceeds the
    character limit) are refused (413 before the rest is read; 400 before tokenizing) while
    /health keeps answering; resident memory ends near where it began."""
    lim = srv.served.limits
    gc.collect()
    rss0 = rss_bytes()
    lat, stop_polling = [], threading.Event()

    def poll():
        while not stop_polling.is_set():
            t = time.perf_counter()
            call(srv.port, "/health")
            lat.append(time.perf_counter() - t)
            time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    try:
        for _ in range(5):
            t = time.perf_counter()
            status, body = _declared_but_not_sent(srv.port, 20 << 20)
            assert status == 413 and is_error_body(body) and "--max-body-bytes" in body["error"]["message"]
            assert time.perf_counter() - t < 5
        big = json.dumps({"model": srv.model, "prompt": "a" * (3_500_000), "max_tokens": 4}).encode()
        assert lim.max_prompt_chars < 3_500_000 < lim.max_body_bytes
        for _ in range(5):
            status, body = post(srv.port, "/v1/completions", big)
            assert (status == 400 and body["error"]["param"] == "prompt"
                    and "--max-prompt-chars" in body["error"]["message"])
        del big
        status, body = _chunked(srv.port, lim.max_body_bytes + 16)
        assert status == 413 and is_error_body(body)
    finally:
        stop_polling.set()
        poller.join(10)
    gc.collect()
    grew = rss_bytes() - rss0
    print(f"[limits] RSS {rss0 / 2 ** 20:.0f} MiB, {grew / 2 ** 20:+.1f} MiB after ten large requests; "
          f"/health slowest {max(lat) * 1e3:.0f} ms over {len(lat)} polls")
    assert grew < 64 << 20, f"RSS grew by {grew / 2 ** 20:.0f} MiB"
    assert lat and max(lat) < 3.0, max(lat)
    assert all_greedy_exact(srv)


def _rendered(monkeypatch) -> list:
    """Counts the chat template's renderings on the request path from now on."""
    from dspark_jax.serve import convert

    calls, real = [], convert.render_text
    monkeypatch.setattr(convert, "render_text", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


def test_a_flood_of_messages_is_refused_before_it_is_validated_or_rendered(srv, monkeypatch):
    """A 3.8 MB body of 127 000 empty messages (within the body bound, no content characters)
    is a 400 naming --max-messages, answered without rendering the chat template; four at once
    leave a normal request's latency as it was."""
    hi = {"model": srv.model, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert post(srv.port, "/v1/chat/completions", hi)[0] == 200  # the template's size per message: measured here
    flood = json.dumps({"model": srv.model, "max_tokens": 4, "messages": [{"role": "user", "content": ""}] * 127_000},
                       separators=(",", ":")).encode()
    assert len(flood) < srv.served.limits.max_body_bytes
    rendered = _rendered(monkeypatch)
    t = time.perf_counter()
    status, body = post(srv.port, "/v1/chat/completions", flood)
    took = time.perf_counter() - t
    assert status == 400 and body["error"]["param"] == "messages" and "--max-messages" in body["error"]["message"]
    assert "127000 messages" in body["error"]["message"] and not rendered
    floods = [in_thread(post, srv.port, "/v1/chat/completions", flood)[0] for _ in range(4)]
    t = time.perf_counter()
    assert complete(srv, PROMPTS[0])[1]["choices"][0]["text"] == srv.texts[0]
    beside = time.perf_counter() - t
    for th in floods:
        th.join(60)
    print(f"[flood] one refused in {took:.2f} s; a normal request beside four took {beside:.2f} s")
    assert took < 2.0 and not rendered


def test_prompt_limit_is_configurable(srv, monkeypatch):
    from dspark_jax.serve import serve_in_thread
    from dspark_jax.serve.app import make_app
    from dspark_jax.serve.convert import message_chars
    from dspark_jax.serve.served import Limits

    served = dataclasses.replace(srv.served, limits=Limits(max_body_bytes=2048, max_prompt_chars=20, max_messages=4))
    server, thread, port = serve_in_thread(make_app(served, owns_loop=False))
    try:
        status, body = complete(srv, "x" * 21, port=port)
        assert status == 400 and "at most 20" in body["error"]["message"]
        status, body = post(port, "/v1/chat/completions", {"model": srv.model, "messages": [
            {"role": "user", "content": "y" * 15}, {"role": "user", "content": "z" * 15}]})
        assert status == 400 and body["error"]["param"] == "messages"
        # the template adds characters per message: two empty messages already exceed 20, known unrendered
        assert message_chars(srv.served.chat_template) > 10
        rendered = _rendered(monkeypatch)
        status, body = post(port, "/v1/chat/completions", {"model": srv.model, "messages": [
            {"role": "user", "content": ""}, {"role": "assistant", "content": ""}]})
        assert status == 400 and body["error"]["param"] == "messages" and "render to at least" in \
            body["error"]["message"] and not rendered
        status, body = post(port, "/v1/chat/completions", {"model": srv.model, "messages": [
            {"role": "user", "content": ""}] * 5})
        assert status == 400 and "at most 4 (--max-messages)" in body["error"]["message"] and not rendered
        monkeypatch.undo()
        assert complete(srv, "x" * 3000, port=port)[0] == 413
        assert complete(srv, PROMPTS[0], port=port)[1]["choices"][0]["text"] == srv.texts[0]
    finally:
        server.should_exit = True
        thread.join(30)


def _raw(port, data: bytes, wait: float = 10.0) -> tuple[bytes, float]:
    """Send `data` on a fresh connection, read until the server closes it -> (what came back,
    seconds until closed); a socket still open after `wait` s fails the test."""
    t = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
        if data:
            sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):  # socket.timeout (an OSError) when nothing is closed
            got += chunk
    return got, time.perf_counter() - t


def test_slow_clients_are_cut_off_after_the_read_timeouts(srv, monkeypatch):
    """With 0.5 s timeouts: a connection that sends nothing, half its headers, or fewer body
    bytes than declared gets a 408 and is closed (the body's request counted as 499); a kept-alive
    connection idle between requests, and a request read in full that takes longer to answer
    (40 tokens at >= 20 ms a round), are not cut."""
    from dspark_jax.serve import serve_in_thread
    from dspark_jax.serve.app import make_app
    from dspark_jax.serve.served import Limits

    prompt = long_prompt(srv)
    served = dataclasses.replace(srv.served, limits=Limits(header_timeout=0.5, body_timeout=0.5))
    server, thread, port = serve_in_thread(make_app(served, owns_loop=False))
    gone = 'dspark_requests_total{endpoint="completions",status="499"}'
    try:
        gone0 = metric(port, gone)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        slow = (b"", head[:30], head, head + b"Content-Length: 100\r\n\r\n" + b'{"model": "x"')
        with ThreadPoolExecutor(4) as ex:
            for data, (got, took) in zip(slow, ex.map(lambda d: _raw(port, d), slow)):
                assert got.startswith(b"HTTP/1.1 408 ") and 0.4 < took < 5, (data, got, took)
                assert is_error_body(json.loads(got.split(b"\r\n\r\n", 1)[1])), got
        assert wait_until(lambda: metric(port, gone) == gone0 + 1, 5)

        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            for i in range(2):  # one connection, idle longer than the header timeout between its requests
                conn.request("POST", "/v1/completions", json.dumps(
                    {"model": srv.model, "prompt": PROMPTS[i], "max_tokens": 12, "temperature": 0}), JSON)
                r = conn.getresponse()
                assert r.status == 200 and json.loads(r.read())["choices"][0]["text"] == srv.texts[i]
                if i == 0:
                    time.sleep(0.8)
        finally:
            conn.close()

        eng, real_step = srv.served.loop.engine, srv.served.loop.engine.step

        def slow_step(st, ctl):  # 40 tokens take >= 0.8 s, past both timeouts
            time.sleep(0.02)
            return real_step(st, ctl)

        monkeypatch.setattr(eng, "step", slow_step)
        t = time.perf_counter()
        status, body = complete(srv, prompt, port=port, max_tokens=40)
        assert status == 200 and body["usage"]["completion_tokens"] == 40 and time.perf_counter() - t > 0.7
    finally:
        server.should_exit = True
        thread.join(30)


# ---------------------------------------------------------------------- last: the engine gives up

def test_an_engine_that_cannot_continue_says_so_and_the_server_exits_nonzero(srv, monkeypatch):
    """Every round raises: each request in flight gets a 500; after three failed rounds in a row
    the loop stops, /health answers 500 "error", later requests 503, and `run_server` (what
    `python -m dspark_jax serve` returns) exits with status 1."""
    from dspark_jax.serve.run import run_server
    from tests.serve.helpers import free_port

    served, eng = srv.served, srv.served.loop.engine
    port = free_port()
    th, rc = in_thread(lambda: run_server(srv.app, served, "127.0.0.1", port, log_config=None, log_level="warning"))
    assert wait_until(lambda: _up(port), 30)

    def broken(st, ctl):
        raise RuntimeError("injected: the device is gone")

    monkeypatch.setattr(eng, "step", broken)
    for _ in range(3):
        status, body = complete(srv, PROMPTS[0], port=port)
        assert status == 500 and "the device is gone" in body["error"]["message"]
    th.join(60)
    assert rc == [1]
    status, _, body = call(srv.port, "/health")
    assert status == 500 and json.loads(body)["status"] == "error"
    assert complete(srv, PROMPTS[0])[0] == 503


def _up(port) -> bool:
    try:
        return call(port, "/health", timeout=2)[0] == 200
    except OSError:
        return False
