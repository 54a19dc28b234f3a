"""HTTP edges found by a hostile-input probe, each on a live server on 127.0.0.1 (tiny embedded
target, target-only, no warm-up: no request here generates) over raw sockets or http.client:
the trailing-slash redirect that echoed the Host header, Content-Length beside
Transfer-Encoding, a body cut short by a half-close, a 413 the client never read, a value
reported as the engine rounds it, the body's media types and encodings, lone surrogates."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("fastapi", reason="fastapi not installed (pip install -e .[serve])")

from tests.serve.helpers import call, is_error_body, post, start, stop  # noqa: E402

BIG = 20 << 20  # a body five times the default bound (4 MiB)


@pytest.fixture(scope="module")
def srv(embedded_tiny_dir):
    served, server, thread, port = start(embedded_tiny_dir, None)
    try:
        yield served, port
    finally:
        stop(server, thread, served)


def _exchange(port, parts, shut=False, timeout=15.0, sent=None) -> tuple[bytes, bool]:
    """Send `parts` (bytes each) on a fresh connection, half-close it with `shut`, then read until
    the server closes -> (what came back, whether the server closed its side). A send the server
    refuses (a reset, a broken pipe) ends the sending, then what can still be read is read;
    `sent` (a list) gets whether every part went out."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    got, closed, whole = b"", False, False
    try:
        try:
            for p in parts:
                s.sendall(p)
            if shut:
                s.shutdown(socket.SHUT_WR)
            whole = True
        except OSError:
            pass
        if sent is not None:
            sent.append(whole)
        try:
            while chunk := s.recv(1 << 16):
                got += chunk
            closed = True
        except OSError:  # a reset, or the timeout: the server did not close cleanly
            pass
    finally:
        s.close()
    return got, closed


def _responses(data: bytes) -> list[tuple[int, dict, object]]:
    """The responses in `data`, each (status, headers, body: JSON or bytes), read by their
    Content-Length."""
    out = []
    while data.startswith(b"HTTP/1.1 "):
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:])}
        n = int(headers.get("content-length", len(rest)))
        body, data = rest[:n], rest[n:]
        try:
            body = json.loads(body)
        except ValueError:
            pass
        out.append((int(lines[0].split()[1]), headers, body))
    return out


def _head(path="/v1/completions", ctype="application/json", extra=b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: %s\r\n" % (path.encode(), ctype.encode())) + extra


def _message(body) -> str:
    assert is_error_body(body), body
    return body["error"]["message"]


# ---------------------------------------------------------------------- 1. trailing slashes

@pytest.mark.parametrize("method,path,right", [("POST", "/v1/chat/completions/", "/v1/chat/completions"),
                                               ("POST", "/v1/completions//", "/v1/completions"),
                                               ("GET", "/v1/models/", "/v1/models")])
def test_a_trailing_slash_is_a_404_naming_the_route_never_a_redirect_to_the_host_header(srv, method, path, right):
    served, port = srv
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = json.dumps({"model": served.model, "messages": [{"role": "user", "content": "hi"}]})
        conn.putrequest(method, path, skip_host=True)
        conn.putheader("Host", "evil.example")
        if method == "POST":
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body.encode() if method == "POST" else None)
        r = conn.getresponse()
        status, headers, text = r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()
    assert status == 404 and "location" not in headers, (status, headers)
    message = _message(json.loads(text))
    assert path in message and f"'{right}'" in message and "evil.example" not in message, message


# ---------------------------------------------------------------------- 2. Content-Length and Transfer-Encoding

def test_content_length_beside_transfer_encoding_is_a_400_and_the_connection_closes(srv):
    """RFC 9112 section 6.1: a server that does not close must treat it as an error (behind a proxy
    that frames by Content-Length, the rest of the chunked body could be a second request). The
    request pipelined after it is never answered."""
    served, port = srv
    body = json.dumps({"model": served.model, "prompt": "hi", "max_tokens": 2}).encode()
    request = _head(extra=b"Content-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n" % len(body)) \
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    got, closed = _exchange(port, [request + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"])
    answers = _responses(got)
    assert [a[0] for a in answers] == [400] and closed, got[:400]
    status, headers, answer = answers[0]
    assert headers.get("connection") == "close"
    message = _message(answer)
    assert "Content-Length" in message and "Transfer-Encoding" in message, message


# ---------------------------------------------------------------------- 3. a body cut short

@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_cut_short_by_a_half_close_is_answered_400(srv, framing):
    served, port = srv
    if framing == "content-length":
        request = _head(extra=b"Content-Length: 100\r\n\r\n") + b'{"model": "x"'
    else:
        request = _head(extra=b"Transfer-Encoding: chunked\r\n\r\n") + b'd\r\n{"model": "x"\r\n'
    t = time.perf_counter()
    got, closed = _exchange(port, [request], shut=True)
    answers = _responses(got)
    assert [a[0] for a in answers] == [400] and closed, got[:400]
    message = _message(answers[0][2])
    assert "shorter than" in message and ("Content-Length (100 bytes)" in message if framing == "content-length"
                                          else "last chunk" in message), message
    assert time.perf_counter() - t < 10  # answered at once, not at the body timeout


# ---------------------------------------------------------------------- 4. 413: the answer before the close

@pytest.mark.parametrize("framing,close", [("content-length", True), ("content-length", False), ("chunked", True)])
def test_a_413_is_read_by_a_client_still_sending_its_body(srv, framing, close):
    """20 MiB sent whole before reading (as http.client, urllib, requests do): every byte goes
    out (the server reads and drops the rest instead of resetting the connection, which broke the
    client's send), the client reads the 413, then the server closes."""
    _, port = srv
    extra = b"Connection: close\r\n" if close else b""
    if framing == "content-length":
        parts = [_head(extra=extra + b"Content-Length: %d\r\n\r\n" % BIG)] + [b" " * (1 << 20)] * (BIG >> 20)
    else:
        parts = [_head(extra=extra + b"Transfer-Encoding: chunked\r\n\r\n")] \
            + [b"100000\r\n" + b" " * (1 << 20) + b"\r\n"] * (BIG >> 20) + [b"0\r\n\r\n"]
    t, sent = time.perf_counter(), []
    got, closed = _exchange(port, parts, sent=sent)
    assert sent == [True] and got.startswith(b"HTTP/1.1 413 "), (sent, got[:200])
    (status, headers, answer), = _responses(got)
    assert "--max-body-bytes" in _message(answer) and headers.get("connection") == "close" and closed
    assert time.perf_counter() - t < 10
    assert call(port, "/health")[0] == 200


def test_urllib_reads_the_413_of_a_body_too_large(srv):
    """urllib sends `Connection: close`: the case where the server used to close with the body
    unread, and the client got a reset instead of the answer."""
    _, port = srv
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=b" " * BIG,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413 and "--max-body-bytes" in _message(json.loads(e.value.read()))


# ---------------------------------------------------------------------- 5. values as sent

def test_a_top_p_the_engine_rounds_to_zero_is_reported_as_sent(srv):
    served, port = srv
    raw = b'{"model": %s, "prompt": "hi", "max_tokens": 2, "top_p": 5e-324}' % json.dumps(served.model).encode()
    status, answer = post(port, "/v1/completions", raw)
    message = _message(answer)
    assert status == 400 and answer["error"]["param"] == "top_p", answer
    assert "5e-324" in message and "got 0.0" not in message, message


# ---------------------------------------------------------------------- 6. media types and encodings

def _json_body(model, encoding="utf-8", bom=b"") -> bytes:
    return bom + json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}, ensure_ascii=False).encode(encoding)


# (content type, how the body is encoded, status, what the message says). The accepted bodies name
# another model: their 400 on `model` shows they passed the rule without generating anything.
BODY_CASES = [
    ("application/json", {}, 400, "model"),
    ("application/json; charset=utf-8", {}, 400, "model"),
    ('Application/JSON; charset="UTF-8"', {}, 400, "model"),
    ("application/vnd.api+json", {}, 400, "model"),
    ("text/json", {}, 400, "model"),
    ("application/json; charset=utf-16", {"encoding": "utf-16"}, 415, "charset=utf-16"),
    ("application/json; charset=latin-1", {}, 415, "charset=latin-1"),
    ("text/plain", {}, 415, "text/plain"),
    ("application/x-www-form-urlencoded", {}, 415, "application/x-www-form-urlencoded"),
    ("application/jsonx", {}, 415, "application/jsonx"),
    ("", {}, 415, "no content type"),
    ("application/json", {"bom": b"\xef\xbb\xbf"}, 400, "byte order mark"),
    ("application/json", {"encoding": "utf-16"}, 400, "UTF-8"),
    ("application/json", {"encoding": "utf-16-le"}, 400, "UTF-8"),
    ("application/json", {"encoding": "utf-32"}, 400, "UTF-8"),
]


@pytest.mark.parametrize("ctype,encoding,status,says", BODY_CASES, ids=[f"{c[0] or 'none'}-{c[1]}" for c in BODY_CASES])
def test_one_rule_for_media_types_and_encodings(srv, ctype, encoding, status, says):
    """JSON media types (application/json, application/*+json, text/json; charset absent or
    utf-8): 415 otherwise. The body: UTF-8 without a byte order mark (RFC 8259 section 8.1): 400
    otherwise."""
    _, port = srv
    got, _, text = call(port, "/v1/completions", _json_body("another-model", **encoding),
                        headers={"Content-Type": ctype} if ctype else {"Content-Type": ""})
    answer = json.loads(text)
    assert got == status and says in _message(answer), (got, answer)
    if says == "model":
        assert answer["error"]["param"] == "model"


# ---------------------------------------------------------------------- 7. lone surrogates

LONE = "\\ud800"
SURROGATE_CASES = [
    (False, '"stop": "%s"' % LONE, "stop"),
    (False, '"stop": ["ok", "a%sb"]' % LONE, "stop[1]"),
    (False, '"user": "%s"' % LONE, "user"),
    (False, '"prompt": "%s"' % LONE, "prompt"),
    (False, '"prompt": ["%s"]' % LONE, "prompt[0]"),
    (True, '"messages": [{"role": "user", "content": "\\udc00"}]', "messages[0].content"),
    (True, '"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]' % LONE,
     "messages[0].content[0].text"),
    (True, '"messages": [{"role": "user", "content": "hi", "name": "%s"}]' % LONE, "messages[0].name"),
    (True, '"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": "%s"}' % LONE,
     "chat_template_kwargs.x"),
    (True, '"messages": [{"role": "user", "content": "hi"}], "%s": 1' % LONE, LONE),
]


@pytest.mark.parametrize("chat,fields,param", SURROGATE_CASES, ids=[c[2] for c in SURROGATE_CASES])
def test_a_lone_surrogate_is_refused_in_every_string_naming_the_field(srv, chat, fields, param):
    served, port = srv
    base = '"model": %s, "max_tokens": 2' % json.dumps(served.model)
    if not chat and '"prompt"' not in fields:
        base += ', "prompt": "hi"'
    status, answer = post(port, "/v1/chat/completions" if chat else "/v1/completions",
                          ("{%s, %s}" % (base, fields)).encode())
    assert status == 400 and answer["error"]["param"] == param and "lone surrogate" in _message(answer), answer


def test_a_surrogate_pair_is_one_character_and_accepted(srv):
    """A pair (an emoji as JSON escapes) is valid Unicode: it passes the rule (the 400 names the
    model, checked after it)."""
    _, port = srv
    raw = b'{"model": "another-model", "prompt": "hi", "stop": "\\ud83d\\ude00", "user": "\\ud83d\\ude00"}'
    status, answer = post(port, "/v1/completions", raw)
    assert status == 400 and answer["error"]["param"] == "model", answer
