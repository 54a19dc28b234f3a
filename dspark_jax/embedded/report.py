"""How good is the embedded target? Held-out loss per domain against a Kneser-Ney-lite bigram."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.embedded.target import (
    DOMAINS,
    Preset,
    _corpora,
    encode_stream,
    get_preset,
)
from dspark_jax.io.hf import load_target
from dspark_jax.text.chat import encode_chat


class BigramKN:
    """Interpolated absolute-discount bigram with Kneser-Ney continuation unigram ("KN-lite").

    ``P(b|a) = max(c(a,b) - d, 0) / c(a) + d * N1+(a,.) / c(a) * Pc(b)``, with
    ``Pc(b) = (N1+(.,b) + 1) / (N1+(.,.) + V)`` (add-one on the continuation counts so no
    token has zero probability); unseen histories back off to ``Pc`` entirely.
    """

    def __init__(self, stream: np.ndarray, vocab_size: int, discount: float = 0.75):
        s = np.asarray(stream, np.int64)
        V = self.V = int(vocab_size)
        self.d = float(discount)
        codes, counts = np.unique(s[:-1] * V + s[1:], return_counts=True)
        self.codes, self.counts = codes, counts.astype(np.float64)
        a, b = codes // V, codes % V
        self.ctx = np.bincount(a, weights=self.counts, minlength=V)
        self.types = np.bincount(a, minlength=V).astype(np.float64)
        cont = np.bincount(b, minlength=V).astype(np.float64)
        self.pcont = (cont + 1.0) / (cont.sum() + V)

    def logprob(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        prev, nxt = np.asarray(prev, np.int64), np.asarray(nxt, np.int64)
        code = prev * self.V + nxt
        i = np.clip(np.searchsorted(self.codes, code), 0, len(self.codes) - 1)
        c = np.where(self.codes[i] == code, self.counts[i], 0.0)
        n = self.ctx[prev]
        safe = np.maximum(n, 1.0)
        p = np.where(n > 0, np.maximum(c - self.d, 0.0) / safe + self.d * self.types[prev] / safe * self.pcont[nxt],
                     self.pcont[nxt])
        return np.log(p)


def _model_nll(model, seqs, masks, seq_len: int, batch: int = 8) -> tuple[float, int]:
    """Summed NLL of the masked next tokens (position t predicted from < t) and their count."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll(state, toks, w):
        logits = nnx.merge(graphdef, state)(toks).logits[:, :-1]
        lp = jax.nn.log_softmax(logits, axis=-1)
        tgt = jnp.take_along_axis(lp, toks[:, 1:, None], axis=-1)[..., 0]
        return -(tgt * w[:, 1:]).sum(), w[:, 1:].sum()

    total, count = 0.0, 0
    for i in range(0, len(seqs), batch):
        toks = np.zeros((batch, seq_len), np.int32)
        w = np.zeros((batch, seq_len), np.float32)
        for r, (s, m) in enumerate(zip(seqs[i:i + batch], masks[i:i + batch])):
            toks[r, :len(s)] = s
            w[r, :len(s)] = m
        a, b = nll(state, toks, w)
        total += float(a)
        count += int(b)
    return total, count


def heldout_report(target_dir=None, *, model=None, tokenizer=None, preset: str | Preset | None = None,
                   seed: int | None = None, max_len: int | None = None) -> dict:
    """Held-out next-token loss (nats/token) per domain: the target vs a KN-lite bigram.

    Scored on the *assistant* tokens (content + ``<|im_end|>``) of held-out conversations,
    each truncated to the target's context (``max_len``, default the training seq_len), with
    the full rendered conversation as context. The bigram is fit on the same training
    token stream the target was pretrained on (rebuilt from the recorded preset and seed).
    """

    hf = {}
    if target_dir is not None:
        lt = load_target(target_dir)
        model, tokenizer, hf = lt.model, lt.require_tokenizer(), lt.hf_config
    info = hf.get("dspark_embedded", {})
    if preset is None:
        preset = Preset(**info["preset"]) if "preset" in info else "full"
    p = get_preset(preset)
    seed = info.get("seed", 0) if seed is None else seed
    max_len = max_len or p.seq_len
    train, held = _corpora(p, seed)
    bigram = BigramKN(encode_stream(tokenizer, train), tokenizer.vocab_size)
    report = {}
    for dom in DOMAINS:
        seqs, masks = [], []
        for conv in held[dom]:
            ids, mask = encode_chat(tokenizer, conv, max_len=max_len)
            seqs.append(ids)
            masks.append(mask.astype(np.float32))
        m_sum, n = _model_nll(model, seqs, masks, max_len)
        b_sum = 0.0
        for s, m in zip(seqs, masks):
            lp = bigram.logprob(s[:-1], s[1:])
            b_sum -= float((lp * m[1:]).sum())
        report[dom] = {"model": m_sum / n, "bigram": b_sum / n, "tokens": n, "conversations": len(seqs)}
    return report


def format_report(report: dict) -> str:
    lines = ["| domain | conversations | assistant tokens | target (nats/token) | KN bigram (nats/token) | margin |",
             "|---|---|---|---|---|---|"]
    for dom, r in report.items():
        lines.append(f"| {dom} | {r['conversations']} | {r['tokens']} | {r['model']:.3f} | {r['bigram']:.3f} | "
                     f"{r['bigram'] - r['model']:.3f} |")
    return "\n".join(lines)


