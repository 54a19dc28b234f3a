"""The OpenAI-compatible server, queried with the official `openai` client on 127.0.0.1 (tiny
embedded target, server started and stopped by the fixture): lossless over the wire, streaming,
cancellation, concurrency with bad requests, the queue bound, errors that name the field."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai", reason="openai not installed (pip install -e .[serve,test])")
pytest.importorskip("fastapi", reason="fastapi not installed (pip install -e .[serve])")

from tests.serve.helpers import PROMPTS  # noqa: E402
from tests.serve.helpers import start as _start  # noqa: E402
from tests.serve.helpers import stop as _stop  # noqa: E402


def _http(url, data: bytes | None = None):
    """(status, body text) of a GET, or of a POST of `data`."""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture(scope="module")
def reference(embedded_tiny_dir):
    """Greedy completions of the target alone (the offline engine), as text."""
    from dspark_jax.decoding.sampling import SamplingParams
    from dspark_jax.engine import Engine, EngineConfig
    from dspark_jax.io.hf import load_target

    lt = load_target(embedded_tiny_dir)
    tok = lt.tokenizer
    eng = Engine(lt.model, None, EngineConfig(policy="fixed", num_slots=4, max_len=128))
    ids = [tok.encode(p) for p in PROMPTS]
    res = eng.generate(ids, max_new_tokens=12, sampling=SamplingParams(0.0, 0, 1.0), stop_ids=tok.stop_ids)
    return [tok.decode(r.tokens, skip_special_tokens=True) for r in res.results], [len(r.tokens) for r in res.results]


@pytest.fixture(scope="module")
def server(embedded_tiny_dir, tiny_dspark_drafter_dir):
    served, srv, thread, port = _start(embedded_tiny_dir, tiny_dspark_drafter_dir)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
    yield served, client, port
    _stop(srv, thread, served)


def test_greedy_over_http_equals_the_target_and_reports_usage(server, reference):
    served, client, _ = server
    texts, lengths = reference
    assert [m.id for m in client.models.list().data] == [served.model]
    for p, want, n in zip(PROMPTS, texts, lengths):
        r = client.completions.create(model=served.model, prompt=p, max_tokens=12, temperature=0)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == n and r.usage.prompt_tokens == len(served.tokenizer.encode(p))
        assert r.choices[0].finish_reason in ("length", "stop")


def test_stream_concatenates_to_the_whole_answer(server):
    served, client, _ = server
    msgs = [{"role": "user", "content": "Write a short story about a robot."}]
    whole = client.chat.completions.create(model=served.model, messages=msgs, max_tokens=30, temperature=0)
    chunks = list(client.chat.completions.create(model=served.model, messages=msgs, max_tokens=30, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens


def test_cancelled_stream_frees_its_slot(server):
    served, client, port = server
    stream = client.completions.create(model=served.model, prompt="Once upon a time", max_tokens=100,
                                       temperature=1.0, seed=3, stream=True)
    next(iter(stream))
    assert served.loop.slots_in_use == 1
    stream.close()
    end = time.monotonic() + 20
    while served.loop.slots_in_use and time.monotonic() < end:
        time.sleep(0.05)
    assert served.loop.slots_in_use == 0
    assert json.loads(_http(f"http://127.0.0.1:{port}/health")[1])["status"] == "ok"


def test_concurrent_requests_mixed_with_bad_ones(server, reference):
    served, client, _ = server
    texts, _ = reference
    bad = [dict(max_tokens=-1, param="max_tokens"), dict(temperature=-0.5, param="temperature"),
           dict(model="gpt-4", param="model"), dict(max_tokens=10_000, param="max_tokens")]

    def good(i):
        r = client.completions.create(model=served.model, prompt=PROMPTS[i % 8], max_tokens=12, temperature=0)
        return r.choices[0].text == texts[i % 8]

    def wrong(b):
        kw = dict(model=served.model, prompt="hi", max_tokens=5, temperature=0)
        kw.update({k: v for k, v in b.items() if k != "param"})
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**kw)
        return e.value.body["param"] == b["param"] and b["param"] in e.value.body["message"]

    with ThreadPoolExecutor(16) as ex:
        goods = list(ex.map(good, range(12)))
        bads = list(ex.map(wrong, bad))
    assert all(goods) and all(bads)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=served.model, messages=[], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="prompt has .* tokens"):
        client.completions.create(model=served.model, prompt="word " * 400, max_tokens=4)
    status, body = _http(f"http://127.0.0.1:{served_port(client)}/v1/completions", b"{not json")
    assert status == 400 and "not valid JSON" in json.loads(body)["error"]["message"]
    metrics = _http(f"http://127.0.0.1:{served_port(client)}/metrics")[1]
    assert 'dspark_requests_total{endpoint="completions",status="400"}' in metrics
    assert "dspark_accepted_length_bucket" in metrics and "dspark_time_to_first_token_seconds_count" in metrics


def served_port(client):
    return client.base_url.port


def test_full_queue_answers_429_and_loses_nothing(server, reference):
    served, client, _ = server
    texts, _ = reference
    served.loop.max_queue = 1
    rejected = []

    def until_done(i):
        while True:
            try:
                r = client.completions.create(model=served.model, prompt=PROMPTS[i % 8], max_tokens=12, temperature=0)
                return r.id, r.choices[0].text
            except openai.RateLimitError as e:
                rejected.append(e.response.headers.get("retry-after"))
                time.sleep(0.05)

    try:
        with ThreadPoolExecutor(16) as ex:
            out = list(ex.map(until_done, range(16)))
    finally:
        served.loop.max_queue = 64
    assert [t for _, t in out] == [texts[i % 8] for i in range(16)]
    assert len({rid for rid, _ in out}) == 16  # no request answered twice
    assert rejected and set(rejected) == {"1"}


def test_paged_kv_server_waits_for_pages_and_refuses_what_never_fits(embedded_tiny_dir, tiny_dspark_drafter_dir,
                                                                     reference):
    """`--kv-pages 5,16`: 4 slots, but the pool holds only 2 of these requests' reach at a time.
    8 concurrent requests all get the target's greedy answers (the others wait for pages, none is
    refused or lost); a request that could not fit the whole pool is a 400 naming max_tokens.
    At a fixed length every round drafts and verifies, so the drafts' positions take pages too."""
    served, srv, thread, port = _start(embedded_tiny_dir, tiny_dspark_drafter_dir, kv_pages=(5, 16), policy="fixed")
    try:
        eng = served.loop.engine
        reach = [eng.pages_to_reserve(len(served.tokenizer.encode(p)), 12) for p in PROMPTS]
        assert max(reach) <= 5 < sum(sorted(reach)[:3])  # never 3 at once: requests must wait
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        texts, _ = reference

        def one(i):
            return client.completions.create(model=served.model, prompt=PROMPTS[i], max_tokens=12,
                                             temperature=0).choices[0].text

        with ThreadPoolExecutor(8) as ex:
            assert list(ex.map(one, range(8))) == texts
        assert eng.pages.peak <= 5
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=served.model, prompt="hi", max_tokens=100, temperature=0)
        assert e.value.body["param"] == "max_tokens" and "page pool" in e.value.body["message"]
    finally:
        _stop(srv, thread, served)


@pytest.mark.parametrize("kind", ["dflash", "eagle3", "mtp1"])
def test_every_drafter_kind_is_lossless_over_http(kind, embedded_tiny_dir, reference, tmp_path):
    """Served at a fixed length, so that every round drafts with the kind and verifies its drafts
    (the default skips an untrained drafter: tests/engine/test_acceptance_skip.py)."""
    from flax import nnx

    from dspark_jax.config import DrafterSection
    from dspark_jax.drafter import registry
    from dspark_jax.drafter.frozen import attach_target
    from dspark_jax.io import drafter_dir as drafter_io
    from dspark_jax.io.hf import load_target
    from dspark_jax.parallel.sharding import create_model

    t = load_target(embedded_tiny_dir)
    dcfg = DrafterSection(kind=kind, num_layers=1, gamma=3, markov_rank=0, target_layer_ids=(1, 3, 5),
                          num_target_features=3, mask_token_id=t.tokenizer.mask_id)
    d = create_model(lambda: registry.build(t.cfg, dcfg, rngs=nnx.Rngs(5)))
    attach_target(d, t.model)
    drafter_io.save(d, tmp_path / kind)
    served, srv, thread, port = _start(embedded_tiny_dir, tmp_path / kind, policy="fixed")
    try:
        assert served.loop.engine.mode == kind
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        texts, _ = reference
        for p, want in list(zip(PROMPTS, texts))[:4]:
            r = client.completions.create(model=served.model, prompt=p, max_tokens=12, temperature=0)
            assert r.choices[0].text == want
    finally:
        _stop(srv, thread, served)


def test_sigterm_finishes_in_flight_requests_and_exits_cleanly(embedded_tiny_dir, tmp_path):
    import os
    import signal
    import socket
    import subprocess
    import sys
    import threading

    from tests.conftest import REPO

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "dspark_jax", "serve", "--target", str(embedded_tiny_dir),
                             "--drafter", "none", "--max-len", "128", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "JAX_PLATFORMS": "cpu"})
    try:
        end = time.monotonic() + 180
        while time.monotonic() < end:  # polled slowly: the server logs each poll to a pipe read only at the end
            try:
                if _http(f"http://127.0.0.1:{port}/health")[0] == 200:  # 503 "starting" while it compiles
                    break
            except OSError:
                pass
            time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        got = {}

        def ask():
            stream = client.completions.create(model=model, prompt="Once upon a time", max_tokens=60,
                                               temperature=1.0, seed=1, stream=True)
            chunks = list(stream)
            got["text"] = "".join(c.choices[0].text for c in chunks if c.choices)
            got["finish"] = chunks[-1].choices[0].finish_reason

        th = threading.Thread(target=ask)
        th.start()
        end = time.monotonic() + 60
        while not json.loads(_http(f"http://127.0.0.1:{port}/health")[1])["slots_in_use"] and time.monotonic() < end:
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        th.join(120)
        code = proc.wait(120)
        log = proc.stdout.read()
        # uvicorn drains open requests, shuts the app down (the engine loop stops), then raises the
        # signal again: the command takes that repeat, so a clean drain exits 0
        assert code == 0 and "Application shutdown complete" in log, (code, log[-3000:])
        assert got.get("finish") in ("length", "stop") and got["text"]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_calibrated_takes_the_fit_for_the_named_sampling_temperature(embedded_tiny_dir, tiny_dspark_drafter_dir,
                                                                     tmp_path):
    """`--calibrated T` serves with the STS temperatures fitted at sampling temperature T (bench
    serve passes its own); a temperature with no fit is refused with the file's settings named."""
    import shutil

    import numpy as np

    from dspark_jax.calibration.calibrate import CalibrationMissingError, save_temperatures
    from dspark_jax.serve import build

    d = tmp_path / "drafter"
    shutil.copytree(tiny_dspark_drafter_dir, d)
    from dspark_jax.io.drafter_dir import read_config

    G = read_config(d)[0].gamma
    fits = {0.0: np.linspace(0.5, 0.9, G), 1.0: np.linspace(1.5, 2.5, G)}
    for t, temps in fits.items():
        save_temperatures(d, (t, 0, 1.0), {"temperatures": temps.tolist()})
    for calibrated, want in ((0.0, fits[0.0]), (True, fits[1.0]), (1.0, fits[1.0]), (None, np.ones(G)),
                             ("auto", fits[1.0])):  # by default: the fit at T = 1 where the drafter has one
        _, served = build(str(embedded_tiny_dir), str(d), slots=2, max_len=64, calibrated=calibrated)
        try:
            np.testing.assert_allclose(np.asarray(served.loop.control.sts), want, rtol=1e-6, err_msg=str(calibrated))
        finally:
            served.loop.stop()
    with pytest.raises(CalibrationMissingError, match=r"T0.5_k0_p1 \(has: T0_k0_p1, T1_k0_p1\)"):
        build(str(embedded_tiny_dir), str(d), slots=2, max_len=64, calibrated=0.5)
