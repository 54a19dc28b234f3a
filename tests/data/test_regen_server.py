"""Regeneration through an OpenAI-compatible server: our own server on 127.0.0.1 (tiny embedded
target), started and stopped here. Greedy answers equal the in-process regeneration's, every
turn in order; an interrupted run resumes with nothing lost or written twice; refusals and a
dead server stop with one message naming the chat."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_jax.commands.regenerate import main
from dspark_jax.data.dataset import TokenDataset
from dspark_jax.data.regen_server import ServerError, regenerate_via_server
from dspark_jax.data.regenerate import regenerate
from dspark_jax.decoding.sampling import SamplingParams

GREEDY = SamplingParams(0.0, 0, 1.0)
MAX_NEW = 8
CHATS = [[{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "old"},
          {"role": "user", "content": "4+4?"}],
         [{"role": "user", "content": "Name a fruit."}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."},
          {"role": "user", "content": "Why?"}],
         [{"role": "user", "content": "def f(x):"}],
         [{"role": "user", "content": "Count: 1, 2,"}, {"role": "user", "content": "Again."}]]


@pytest.fixture(scope="module")
def server(embedded_tiny_dir):
    from dspark_jax.serve import build, serve_in_thread

    app, served = build(str(embedded_tiny_dir), "none", slots=4, max_len=128)
    srv, thread, port = serve_in_thread(app)
    assert srv.started
    yield f"http://127.0.0.1:{port}", served.model
    srv.should_exit = True
    thread.join(30)
    served.loop.stop()


def _answers(tok, rec):
    """The trained-on spans of a record, as text (one per regenerated answer)."""
    ids, mask = rec["tokens"], rec["loss_mask"]
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [tok.decode(ids[a:b].tolist(), skip_special_tokens=True) for a, b in zip(edges[::2], edges[1::2])]


def test_server_answers_equal_in_process_ones_turn_by_turn(server, embedded_tiny_dir, tmp_path):
    from dspark_jax.io.hf import load_target

    url, model = server
    stats = regenerate_via_server(url, model, embedded_tiny_dir, CHATS, tmp_path / "srv", concurrency=3,
                                  max_new_tokens=MAX_NEW, sampling=GREEDY, progress=False, verbose=False)
    assert stats["records"] == 5 and stats["turns"] == 8
    lt = load_target(embedded_tiny_dir)
    regenerate(lt, CHATS, tmp_path / "local", batch_size=5, max_new_tokens=MAX_NEW, max_prompt_len=96,
               sampling=GREEDY, progress=False, verbose=False)
    a, b = TokenDataset(tmp_path / "srv"), TokenDataset(tmp_path / "local")
    n_answers = [2, 1, 2, 1, 2]
    for i in range(5):
        ours, theirs = _answers(lt.tokenizer, a[i]), _answers(lt.tokenizer, b[i])
        assert len(ours) == n_answers[i] and ours == theirs, (i, ours, theirs)


def test_interrupted_run_resumes_without_loss_or_duplicates(server, embedded_tiny_dir, tmp_path):
    url, model = server
    kw = dict(concurrency=3, max_new_tokens=MAX_NEW, sampling=SamplingParams(1.0, 0, 1.0), seed=3,
              progress=False, verbose=False)
    regenerate_via_server(url, model, embedded_tiny_dir, CHATS, tmp_path / "full", **kw)

    def crash(i, t, m):
        if i == 2:
            raise KeyboardInterrupt

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        regenerate_via_server(url, model, embedded_tiny_dir, CHATS, out, on_record=crash, **kw)
    seen = []
    regenerate_via_server(url, model, embedded_tiny_dir, CHATS, out, resume=True,
                          on_record=lambda i, t, m: seen.append(i), **kw)
    assert seen == [3, 4]  # records 0..2 were kept (2 was written before the crash); none twice
    full, res = TokenDataset(tmp_path / "full"), TokenDataset(out)
    assert len(res) == len(full) == 5
    for i in range(5):  # seeded per chat and turn: the same records
        np.testing.assert_array_equal(full[i]["tokens"], res[i]["tokens"])
        np.testing.assert_array_equal(full[i]["loss_mask"], res[i]["loss_mask"])
    with pytest.raises(ValueError, match="seed"):
        regenerate_via_server(url, model, embedded_tiny_dir, CHATS, out, resume=True, **{**kw, "seed": 4})


def test_a_refused_request_names_the_chat_and_keeps_what_was_written(server, embedded_tiny_dir, tmp_path):
    url, model = server
    chats = CHATS[:2] + [[{"role": "user", "content": "word " * 200}]] + CHATS[3:]  # longer than the context
    with pytest.raises(ServerError, match=r"chat 2: HTTP 400: .*messages"):
        regenerate_via_server(url, model, embedded_tiny_dir, chats, tmp_path / "o", concurrency=1,
                              max_new_tokens=MAX_NEW, sampling=GREEDY, progress=False, verbose=False)
    assert (tmp_path / "o.partial").exists()


def test_cli_without_a_server_is_one_line(embedded_tiny_dir, tmp_path, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once closed
    rc = main(["--target", str(embedded_tiny_dir), "--out", str(tmp_path / "x"), "--server", f"http://127.0.0.1:{port}",
               "--num-prompts", "1", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: cannot list the models") and err.count("\n") == 1


def test_thinking_flag_reaches_the_template_as_vllm_sends_it(server, embedded_tiny_dir, tmp_path):
    from dspark_jax.data.regen_server import _post

    url, model = server
    body = {"model": model, "messages": CHATS[1], "max_tokens": 2, "temperature": 0}
    ok = _post(f"{url}/v1/chat/completions", {**body, "chat_template_kwargs": {"enable_thinking": False}}, 60, 0)
    assert ok["choices"][0]["message"]["content"] == _post(f"{url}/v1/chat/completions", body, 60, 0)["choices"][0][
        "message"]["content"]
    with pytest.raises(ServerError, match="HTTP 400: 'chat_template_kwargs'"):
        _post(f"{url}/v1/chat/completions", {**body, "chat_template_kwargs": {"messages": []}}, 60, 0)
    stats = regenerate_via_server(url, model, embedded_tiny_dir, CHATS[:1], tmp_path / "t", max_new_tokens=2,
                                  sampling=GREEDY, thinking=False, progress=False, verbose=False)
    assert stats["records"] == 1
    assert TokenDataset(tmp_path / "t").meta["info"]["regenerate"]["thinking"] is False
