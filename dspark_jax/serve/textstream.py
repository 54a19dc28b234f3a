"""A request's committed token ids -> the text deltas a client is sent, and where a stop string
ends it. Tokens arrive a round at a time; text must not: a token may be half a UTF-8 character
and the last characters may be the start of a stop string, so both are held back until known."""

from __future__ import annotations


class TextStream:
    """Token ids -> text deltas: holds back an incomplete UTF-8 tail and anything that may still
    become a stop string; `cut` is where a stop string begins (then the request ends)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = 0
        self.cut: int | None = None

    def text(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def find_stop(self, ids) -> int | None:
        """How many of `ids` to keep when a stop string appeared in their text, else None."""
        text = self.text(ids)
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if not hits:
            return None
        self.cut = min(hits)
        keep = len(ids)
        while keep > 0 and len(self.text(ids[: keep - 1])) >= self.cut:
            keep -= 1
        return keep

    def delta(self, ids, final: bool) -> str:
        text = self.text(ids)
        if self.cut is not None:
            text = text[: self.cut]
        end = len(text) if final else len(text.rstrip("\ufffd")) - self.hold
        out = text[self.sent: max(end, self.sent)]
        self.sent += len(out)
        return out
