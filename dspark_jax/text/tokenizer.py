"""Byte-level BPE tokenizer training plus a thin wrapper over ``tokenizers``.

One ``Tokenizer`` class serves both our small trained tokenizer (CPU experiments) and a
real Qwen3 ``tokenizer.json``, so data and generation code never care which is used.
Byte-level BPE (no normalizer, no prefix space) makes ``decode(encode(s)) == s`` exact.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"  # reserved drafter mask token (never produced by text)
PAD = "<|pad|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END, MASK, PAD)


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096, save_path=None,
                    min_frequency: int = 2) -> "Tokenizer":
    """Train a byte-level BPE on ``texts``; special tokens get ids 0..4 in SPECIAL_TOKENS order."""
    tok = _HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = Tokenizer(tok)
    if save_path is not None:
        out.save(save_path)
    return out


def _resolve(path) -> tuple[Path, Path]:
    """(tokenizer.json file, its directory) for a file or directory path."""
    p = Path(path)
    if p.is_dir():
        f = p / "tokenizer.json"
        if not f.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in directory {p}: this command needs a tokenizer "
                f"(train one or point at a model directory that has tokenizer.json)")
        return f, p
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer file {p} not found (directory {p.parent}): this command needs a tokenizer")
    return p, p.parent


class Tokenizer:
    """Minimal interface used across the project: encode/decode and special ids."""

    def __init__(self, tok: _HFTokenizer, config: dict | None = None, fingerprint: str | None = None):
        self._tok = tok
        self.config = config or {}
        self._fingerprint = fingerprint

    @classmethod
    def load(cls, path) -> "Tokenizer":
        """From a ``tokenizer.json`` path or a directory containing one (plus optional tokenizer_config.json)."""
        f, d = _resolve(path)
        raw = f.read_bytes()
        config = {}
        cfg = d / "tokenizer_config.json"
        if cfg.is_file():
            config = json.loads(cfg.read_text(encoding="utf-8"))
        return cls(_HFTokenizer.from_str(raw.decode("utf-8")), config, hashlib.sha256(raw).hexdigest())

    def save(self, path) -> Path:
        """Save as ``tokenizer.json`` (``path`` may be a directory or a .json file)."""
        p = Path(path)
        if p.suffix != ".json":
            p.mkdir(parents=True, exist_ok=True)
            p = p / "tokenizer.json"
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(p))
        self._fingerprint = None
        return p

    @property
    def fingerprint(self) -> str:
        """sha256 of the serialized tokenizer (recorded in dataset metadata)."""
        if self._fingerprint is None:
            self._fingerprint = hashlib.sha256(self._tok.to_str().encode("utf-8")).hexdigest()
        return self._fingerprint

    def encode(self, text: str) -> list[int]:
        # add_special_tokens=False: templates place specials explicitly; special-token
        # strings inside text still map to their ids.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def _config_token(self, key: str) -> int | None:
        v = self.config.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return self.token_to_id(v) if isinstance(v, str) else None

    @property
    def eos_id(self) -> int:
        """End of an assistant turn: tokenizer_config eos_token, else <|im_end|>, else <|endoftext|>."""
        for i in (self._config_token("eos_token"), self.token_to_id(IM_END), self.token_to_id(ENDOFTEXT)):
            if i is not None:
                return i
        raise ValueError("tokenizer has no eos token (<|im_end|> or <|endoftext|>)")

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """All ids that end generation (eos plus <|im_end|>/<|endoftext|> when present)."""
        ids = [self.eos_id] + [self.token_to_id(t) for t in (IM_END, ENDOFTEXT)]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    @property
    def pad_id(self) -> int:
        """<|pad|> if present, else tokenizer_config pad_token, else <|endoftext|> (Qwen convention)."""
        for i in (self.token_to_id(PAD), self._config_token("pad_token"), self.token_to_id(ENDOFTEXT)):
            if i is not None:
                return i
        return self.eos_id

    @property
    def mask_id(self) -> int | None:
        """Drafter mask token id, or None (e.g. Qwen3, whose mask row lies past the tokenizer vocab)."""
        return self.token_to_id(MASK)
