"""Regeneration through any OpenAI-compatible chat server (vLLM, SGLang, sglang-jax, our own).

The reference regenerates its training data with SGLang servers; on a TPU VM the same job
runs against vLLM-TPU or ``python -m dspark_jax serve``. Each chat's turns go to
``/v1/chat/completions`` in order, turn k conditioned on the server's earlier answers
(``data.multiturn``); ``--concurrency`` chats are in flight at once. Records are written in
chat order (a finished chat waits for the ones before it), so the dataset always holds a
prefix of the chats and ``resume`` continues after ``len(dataset)``: nothing is lost or
written twice whatever the crash. Records are tokenized here with the target's tokenizer and
chat template (``--target``), the answers' end-of-turn unmasked when the server stopped at
``max_tokens`` (``finish_reason: length``).

Chat i, turn k asks for ``seed + i * 1000 + k`` (servers that honour seeds then give the same
data again); 429 / 503 are retried after ``Retry-After``, connection errors with backoff.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

from dspark_jax.console import progress_bar
from dspark_jax.data.dataset import DatasetWriter, recorded_info
from dspark_jax.data.multiturn import (
    as_arrays,
    encode_conversation,
    history_answer,
    turn_prompts,
)
from dspark_jax.data.regen_defaults import DEFAULT_SAMPLING
from dspark_jax.decoding.params import SamplingParams
from dspark_jax.text.chat import load_chat_template
from dspark_jax.text.tokenizer import Tokenizer

RETRY_STATUS = (429, 503)

log = logging.getLogger(__name__)


class ServerError(ConnectionError):
    """A request the server refused or could not answer (named by chat and turn)."""


def _post(url: str, body: dict, timeout: float, retries: int) -> dict:
    data = json.dumps(body).encode()
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            text = e.read().decode(errors="replace")
            if e.code in RETRY_STATUS and attempt < retries:
                time.sleep(float(e.headers.get("Retry-After") or 1.0))
                continue
            try:
                text = json.loads(text)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                pass
            raise ServerError(f"HTTP {e.code}: {text}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            if attempt < retries:
                time.sleep(min(2.0 ** attempt, 30.0))
                continue
            raise ServerError(f"no answer from {url} ({e})") from None
    raise AssertionError("unreachable")


def served_model(base: str, timeout: float = 30.0) -> str:
    """The first model a server lists (``GET /v1/models``)."""
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=timeout) as r:
            return json.loads(r.read())["data"][0]["id"]
    except (urllib.error.URLError, ConnectionError, TimeoutError, KeyError, IndexError, ValueError) as e:
        raise ServerError(f"cannot list the models of {base} ({e}): is the server up? "
                          "pass --model-name NAME") from None


def answer_chat(base: str, model: str, turns, *, max_new_tokens: int, sampling: SamplingParams, seed: int,
                thinking: bool | None, timeout: float = 600.0, retries: int = 8) -> tuple[list[dict], set[int], int]:
    """Ask the server every turn in order -> (messages with its answers, indices of answers cut by
    max_tokens, completion tokens)."""
    msgs, cut, used = [], set(), 0
    for k, prompt in enumerate(turns):
        body = {"model": model, "messages": msgs + prompt, "max_tokens": int(max_new_tokens),
                "temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                "top_k": int(sampling.top_k) if sampling.top_k > 0 else -1, "seed": int(seed) + k}
        if thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": bool(thinking)}
        out = _post(f"{base}/v1/chat/completions", body, timeout, retries)
        choice = out["choices"][0]
        text = choice["message"]["content"] or ""
        used += int((out.get("usage") or {}).get("completion_tokens", 0))
        last = k == len(turns) - 1
        msgs = msgs + prompt + [{"role": "assistant", "content": text if last else history_answer(text)}]
        if choice.get("finish_reason") == "length":
            cut.add(len(msgs) - 1)
    return msgs, cut, used


def regenerate_via_server(server: str, model: str | None, target, conversations, out_dir, *, num: int | None = None,
                          concurrency: int = 16, max_new_tokens: int = 4096,
                          sampling: SamplingParams = DEFAULT_SAMPLING, seed: int = 0,
                          thinking: bool | None = None, resume: bool = False, overwrite: bool = False,
                          progress: bool = True, on_record=None, verbose: bool = True,
                          timeout: float = 600.0) -> dict:
    """Write ``num`` records regenerated by ``server`` to ``out_dir``; returns stats.

    ``target``: the target's HF directory (its tokenizer and chat template).
    """
    tok, template = Tokenizer.load(target), load_chat_template(target)
    base = server.rstrip("/").removesuffix("/v1")
    model = model or served_model(base)
    n_avail = len(conversations)
    num = n_avail if num is None else int(num)
    if not 0 <= num <= n_avail:
        raise ValueError(f"num={num} but only {n_avail} prompts are available: "
                         f"pass --num-prompts <= {n_avail} or more prompts")
    if concurrency < 1 or max_new_tokens < 1:
        raise ValueError("concurrency and max_new_tokens must be >= 1")
    kwargs = {} if thinking is None else {"enable_thinking": bool(thinking)}
    info = {"regenerate": {"server": base, "model": model, "seed": int(seed),
                           "temperature": float(sampling.temperature),
                           "top_k": int(sampling.top_k), "top_p": float(sampling.top_p),
                           "max_new_tokens": int(max_new_tokens), "thinking": thinking}}
    stats = {"records": 0, "turns": 0, "generated_tokens": 0, "cut_answers": 0, "seconds": 0.0}
    if resume:
        old = recorded_info(out_dir, "regenerate")
        if old is not None:
            diff = [k for k in info["regenerate"] if k != "server" and old.get(k) != info["regenerate"][k]]
            if diff:
                raise ValueError(f"cannot resume {out_dir}: settings {diff} differ from the interrupted run "
                                 f"({ {k: old.get(k) for k in diff} }); rerun with the same settings or --overwrite")

    def one(i):
        turns = turn_prompts(conversations[i])
        try:
            msgs, cut, used = answer_chat(base, model, turns, max_new_tokens=max_new_tokens, sampling=sampling,
                                          seed=seed + 1000 * i, thinking=thinking, timeout=timeout)
        except ServerError as e:
            raise ServerError(f"chat {i}: {e}") from None
        ids, mask = encode_conversation(tok, msgs, template, frozenset(cut), **kwargs)
        return as_arrays(ids, mask), len(turns), len(cut), used

    t0 = time.time()
    with DatasetWriter(out_dir, resume=resume, overwrite=overwrite, vocab_size=tok.vocab_size,
                       tokenizer_hash=tok.fingerprint, info=info) as writer:
        start = len(writer)
        bar = progress_bar(total=num, initial=min(start, num), desc="regenerate", enabled=progress, unit="chat")
        done, nxt, pending = {}, start, {}
        pool = ThreadPoolExecutor(concurrency)
        try:
            todo = iter(range(start, num))
            for i in todo:
                pending[pool.submit(one, i)] = i
                if len(pending) >= concurrency:
                    break
            while pending:
                finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in finished:
                    i = pending.pop(f)
                    done[i] = f.result()  # a failure stops here; the records before it are kept
                    nxt_i = next(todo, None)
                    if nxt_i is not None:
                        pending[pool.submit(one, nxt_i)] = nxt_i
                while nxt in done:  # write in chat order
                    (record, mask), n_turns, n_cut, used = done.pop(nxt)
                    writer.add(record, mask)
                    stats["records"] += 1
                    stats["turns"] += n_turns
                    stats["cut_answers"] += n_cut
                    stats["generated_tokens"] += used
                    if on_record is not None:
                        on_record(nxt, record, mask)
                    nxt += 1
                    bar.update(1)
                el = time.time() - t0
                bar.set_postfix(tok_s=f"{stats['generated_tokens'] / max(el, 1e-9):.0f}")
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
    stats["seconds"] = time.time() - t0
    stats["tokens_per_s"] = stats["generated_tokens"] / max(stats["seconds"], 1e-9)
    if verbose:
        log.info(f"{stats['records']} chats ({stats['turns']} turns, {stats['generated_tokens']} tokens, "
                 f"{stats['cut_answers']} answers cut by max_tokens) via {base} in {stats['seconds']:.1f} s: "
                 f"{stats['tokens_per_s']:.1f} tokens/s -> {out_dir}")
    return stats
