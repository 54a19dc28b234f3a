"""The server under generated and sustained traffic (tiny embedded target, target-only, 4 slots,
on 127.0.0.1): a property-based storm of valid and mutated requests, then a soak with clients
that hang up. Every answer must be a 2xx or a 4xx with an OpenAI-style error body (never a 500,
never a hang), and afterwards the server must be as it was: slots and queue empty, memory
near its start, the same greedy text."""

from __future__ import annotations

import http.client
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (pip install -e .[serve])")
hypothesis = pytest.importorskip("hypothesis", reason="hypothesis not installed (pip install -e .[test])")

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from tests.serve.helpers import (
    PROMPTS,
    is_error_body,
    metric,
    post,
    rss_bytes,
    start,
    stop,
    wait_until,
)

MODEL = "target"  # --model-name of the fixture's server: generated bodies can name it before it starts
TIMEOUT = 30.0  # no single answer may take longer: a hang fails the test


@pytest.fixture(scope="module")
def srv(embedded_tiny_dir):
    served, server, thread, port = start(embedded_tiny_dir, None, model_name=MODEL)
    try:
        def greedy():
            return [post(port, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 8, "temperature": 0})
                    [1]["choices"][0]["text"] for p in PROMPTS[:4]]

        yield SimpleNamespace(served=served, port=port, greedy=greedy, before=greedy())
    finally:
        stop(server, thread, served)


def _errors_500(port) -> float:
    return sum(metric(port, f'dspark_requests_total{{endpoint="{e}",status="500"}}') for e in ("completions", "chat"))


def _send(port, path: str, raw: bytes, headers: dict):
    """(status, body text); a streamed answer is read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        conn.request("POST", path, body=raw, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheader("content-type") or "", r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def check_answer(status: int, ctype: str, text: str) -> None:
    assert 200 <= status < 300 or 400 <= status < 500, (status, text[:300])
    if status >= 400:
        assert is_error_body(json.loads(text)), text[:300]
    elif ctype.startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        assert text.rstrip().endswith("data: [DONE]") and not any("error" in e for e in events), text[-300:]
    else:
        assert json.loads(text)["choices"], text[:300]


# ---------------------------------------------------------------------- generated requests

leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2 ** 70), 2 ** 70),
                 st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
value = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=6), c,
                                                                                           max_size=3)), max_leaves=8)
text = st.one_of(st.sampled_from(PROMPTS), st.text(min_size=1, max_size=40))
part = st.one_of(st.builds(lambda t: {"type": "text", "text": t}, text),
                 st.sampled_from([{"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]))
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant", "user", "tool"]),
                                 "content": st.one_of(text, st.lists(part, max_size=3), st.none())})
sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(1, 4), "temperature": st.one_of(st.just(0), st.floats(0, 2)),
    "top_p": st.floats(0.05, 1), "top_k": st.one_of(st.integers(-1, 300), st.just(2 ** 31), st.just(2 ** 63)),
    "seed": st.integers(0, 2 ** 40), "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(
        st.text(min_size=1, max_size=4), min_size=1, max_size=4)),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "n": st.just(1), "user": st.text(max_size=8), "frequency_penalty": st.just(0)})
MUTATIONS = ["none", "none", "set", "drop", "extra", "truncate", "constant", "nest", "content-type", "bytes"]
FIELDS = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
          "stream_options", "n", "logprobs", "logit_bias", "presence_penalty", "chat_template_kwargs", "echo"]


@st.composite
def requests(draw):
    """(path, raw body, headers): a valid request, or one mutated at a field, in its bytes or headers."""
    chat = draw(st.booleans())
    body = {"model": MODEL, **draw(sampling)}
    if chat:
        body["messages"] = draw(st.lists(message, min_size=1, max_size=3))
    else:
        body["prompt"] = draw(st.one_of(text, st.lists(st.integers(0, 200), min_size=1, max_size=8)))
    body.setdefault("max_tokens", 4)
    kind = draw(st.sampled_from(MUTATIONS))
    headers = {"Content-Type": "application/json"}
    if kind == "set":
        body[draw(st.sampled_from(FIELDS))] = draw(value)
    elif kind == "drop":
        body.pop(draw(st.sampled_from(sorted(k for k in body if k != "max_tokens"))), None)
    elif kind == "extra":
        body[draw(st.text(min_size=1, max_size=10))] = draw(value)
    raw = json.dumps(body).encode()
    if kind == "truncate":
        raw = raw[: draw(st.integers(0, len(raw) - 1))]
    elif kind == "constant":
        raw = raw.replace(b'"max_tokens": ', b'"max_tokens": ' + draw(st.sampled_from([b"NaN, \"x\": ",
                                                                                       b"-Infinity, \"x\": ",
                                                                                       b"1e999, \"x\": "])))
    elif kind == "nest":
        depth = draw(st.integers(20, 5000))
        raw = raw[:-1] + b', "deep": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "content-type":
        headers["Content-Type"] = draw(st.sampled_from(["text/plain", "application/x-www-form-urlencoded", ""]))
    elif kind == "bytes":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.binary(min_size=1, max_size=8)) + raw[at:]
    return "/v1/chat/completions" if chat else "/v1/completions", raw, headers


def test_generated_requests_never_get_a_500_or_hang(srv):
    """>= 500 generated requests (hypothesis; valid ones and ones mutated in a field, their bytes
    or their headers), one at a time: each answered within 30 s with a 2xx or a 4xx carrying an
    OpenAI-style error; no 500 counted; the same greedy text after the storm."""
    sent, statuses = [], []

    @settings(max_examples=500, deadline=None, database=None, derandomize=True, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck))
    @example(("/v1/completions", json.dumps({"model": MODEL, "prompt": "x",
                                             "max_tokens": 2, "top_k": 2 ** 31}).encode(),
              {"Content-Type": "application/json"}))
    @example(("/v1/completions", b'{"model": "target", "prompt": "x", "stream": "false"}',
              {"Content-Type": "application/json"}))
    @example(("/v1/chat/completions", (b'{"model": "target", "messages": [{"role": "user", "content": "x"}], '
                                       b'"stream": true, "stream_options": 5}'), {"Content-Type": "application/json"}))
    @example(("/v1/completions", b'{"model": "target", "prompt": "\\ud800", "\\udfff": 1}',
              {"Content-Type": "application/json"}))
    @example(("/v1/completions", b'{"model": "target", "prompt": "\\ud800x"}', {"Content-Type": "application/json"}))
    @given(requests())
    def storm(req):
        path, raw, headers = req
        t = time.perf_counter()
        status, ctype, answer = _send(srv.port, path, raw, headers)
        sent.append(time.perf_counter() - t)
        statuses.append(status)
        check_answer(status, ctype, answer)

    storm()
    assert len(sent) >= 500 and max(sent) < TIMEOUT
    assert sum(s == 200 for s in statuses) >= 100 and sum(s == 400 for s in statuses) >= 100  # both sides explored
    print(f"[fuzz] {len(sent)} requests in {sum(sent):.1f} s, slowest {max(sent):.2f} s, statuses "
          f"{ {k: statuses.count(k) for k in sorted(set(statuses))} }")
    assert _errors_500(srv.port) == 0 and srv.served.loop.failed_requests == 0
    assert wait_until(lambda: srv.served.loop.slots_in_use == 0 and srv.served.loop.queue_depth == 0, 10)
    assert srv.greedy() == srv.before


# ---------------------------------------------------------------------- soak

def _soak_one(port, plan):
    """One client of the soak: what it did ('ok', 'refused', 'left')."""
    kind, seed = plan
    rng = random.Random(seed)
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "max_tokens": rng.randint(1, 16), "temperature": rng.choice([0, 0.8]), "seed": seed}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    else:
        body["prompt"] = rng.choice(PROMPTS)
    if kind == "bad":
        body[rng.choice(["temperature", "top_k", "stream", "logit_bias"])] = rng.choice(["x", -5, {"1": 1}])
    if kind in ("stream", "hangup"):
        body["stream"] = True
    conn = http.client.HTTPConnection("127.0.0.1", port,
                                      timeout=rng.uniform(0.05, 0.5) if kind == "timeout" else TIMEOUT)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if kind == "hangup":
            r.fp.readline()
            return "left"
        check_answer(r.status, r.getheader("content-type") or "", r.read().decode())
        return "ok" if r.status == 200 else "refused"
    except TimeoutError:
        assert kind == "timeout"
        return "left"
    finally:
        conn.close()


def test_soak_with_clients_that_leave_returns_to_idle(srv):
    """200 mixed requests (completions and chat, streamed or not, sampled or greedy, some
    refused) at concurrency 32, with a quarter of the clients leaving early (hang-ups mid-stream,
    time-outs): afterwards no slot is held, the queue is empty, RSS is within 10 % of its start,
    no request failed inside the engine."""
    rng = random.Random(7)
    kinds = ["plain"] * 90 + ["stream"] * 40 + ["hangup"] * 25 + ["timeout"] * 25 + ["bad"] * 20
    rng.shuffle(kinds)
    plan = [(k, i) for i, k in enumerate(kinds)]
    _soak_one(srv.port, ("plain", 10_000))  # this test's shapes compiled before memory is measured
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(32) as ex:
        done = list(ex.map(lambda p: _soak_one(srv.port, p), plan))
    assert len(done) == 200 and done.count("refused") == 20 and done.count("left") >= 25
    loop = srv.served.loop
    assert wait_until(lambda: loop.slots_in_use == 0 and loop.queue_depth == 0, 10)
    assert _errors_500(srv.port) == 0 and loop.failed_requests == 0 and loop.error is None
    rss1 = rss_bytes()
    print(f"[soak] {len(done)} requests in {time.perf_counter() - t0:.1f} s: {done.count('ok')} answered, "
          f"{done.count('refused')} refused, {done.count('left')} left; RSS {rss0 / 2 ** 20:.0f} -> "
          f"{rss1 / 2 ** 20:.0f} MiB")
    assert abs(rss1 - rss0) < 0.10 * rss0, (rss0 / 2 ** 20, rss1 / 2 ** 20)
    assert srv.greedy() == srv.before
