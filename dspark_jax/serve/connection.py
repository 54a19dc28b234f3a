"""HTTP/1.1 edges of a connection that uvicorn leaves open, and how this server closes them.

- Framing (`RefuseAmbiguousFraming`, ASGI middleware, any server): a request with both
  `Content-Length` and `Transfer-Encoding` is answered 400 and its connection closed (RFC 9112
  section 6.1: behind a proxy that frames it by `Content-Length`, the rest of a chunked body could
  be a second, smuggled request). Nothing after it on the connection is read as a request.
- A body cut short (`ConnectionEdges`, a protocol mixin): a client that half-closes its side
  (shutdown(SHUT_WR)) before its body's last byte (its `Content-Length`, or the last chunk) gets
  a 400 saying so, then the connection closes; the request sees its client gone (counted as 499,
  as a body that times out). uvicorn would close without a word.
- Lingering close (`ConnectionEdges`): when the server closes a connection right after answering
  a request whose body is still arriving (a 413 before the body is read, the 400 above, any early
  answer to a client that sent `Connection: close`), it half-closes its side after the answer
  and reads and drops what the client still sends (at most `LINGER_BYTES`, for at most
  `LINGER_SECONDS`, until the client closes) before closing. Closing with unread bytes makes the
  kernel answer them with a reset, and a client still sending its body then gets the reset
  instead of the answer (Apache's and nginx's lingering close). A read timeout (serve/timeouts.py)
  closes at once.

`http_protocol` puts the mixin and the read timeouts over the HTTP protocol class uvicorn picks;
the mixin reads only what uvicorn's protocols share (`cycle`, `cycle.more_body`,
`cycle.response_started`, `cycle.response_complete`, `cycle.scope`, `transport`, `loop`)."""

from __future__ import annotations

import asyncio
import logging

from dspark_jax.serve.errors import error
from dspark_jax.serve.timeouts import ReadTimeouts

log = logging.getLogger(__name__)

LINGER_SECONDS = 5.0
LINGER_BYTES = 64 << 20

_BAD_REQUEST = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s")


class RefuseAmbiguousFraming:
    """ASGI middleware: 400 (and the connection closed) for a request that frames its body both
    by `Content-Length` and by `Transfer-Encoding`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope.get("headers", ())}
            if b"content-length" in names and b"transfer-encoding" in names:
                await error(400, "the request has both a Content-Length and a Transfer-Encoding header: send one "
                                 "(RFC 9112 section 6.1); the connection is closed",
                            headers={"Connection": "close"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _Transport:
    """The connection's transport as the protocol's code sees it: its `close` asks the protocol
    (`ConnectionEdges.close_transport`), which may linger first; while it lingers the connection
    reads on and counts as closing."""

    def __init__(self, raw: asyncio.Transport, protocol: ConnectionEdges):
        self._raw, self._protocol = raw, protocol

    def __getattr__(self, name):
        return getattr(self._raw, name)

    def close(self) -> None:
        self._protocol.close_transport()

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._raw.is_closing()

    def pause_reading(self) -> None:
        if not self._protocol.lingering:  # what arrives while lingering is dropped, never buffered
            self._raw.pause_reading()


class ConnectionEdges:
    """Mixed in before a uvicorn HTTP protocol class (and before `ReadTimeouts`): see the module's
    docstring."""

    lingering: bool = False
    _raw: asyncio.Transport | None = None
    _lost = False
    _closing_now = False
    _linger_timer: asyncio.TimerHandle | None = None
    _dropped = 0

    # ------------------------------------------------------------ the protocol's events
    def connection_made(self, transport) -> None:
        self._raw = transport
        super().connection_made(_Transport(transport, self))

    def data_received(self, data: bytes) -> None:
        if self.lingering:
            self._dropped += len(data)
            if self._dropped > LINGER_BYTES:
                self._close_now()
            return
        super().data_received(data)

    def eof_received(self):
        if self.lingering:
            self._close_now()
            return None
        cycle = getattr(self, "cycle", None)
        if cycle is not None and cycle.more_body and not cycle.response_started and not self._raw.is_closing():
            self._refuse_cut_short(cycle)
            return None  # the transport closes itself once the answer is written
        return super().eof_received()

    def connection_lost(self, exc) -> None:
        self._lost = True
        self.lingering = False
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        super().connection_lost(exc)

    def _expired(self) -> None:  # a read timeout (serve/timeouts.py): no lingering for a slow client
        self._closing_now = True
        super()._expired()

    # ------------------------------------------------------------ closing
    def close_transport(self) -> None:
        """What the protocol's `transport.close()` does: linger when a request's body is still
        arriving after its answer, else close."""
        if self.lingering:
            return
        cycle = getattr(self, "cycle", None)
        if (self._lost or self._closing_now or self._raw.is_closing() or cycle is None
                or not cycle.response_complete or not cycle.more_body):
            self._raw.close()
            return
        self.lingering = True
        raw = self._raw
        if raw.can_write_eof():
            raw.write_eof()  # sent once the answer is written: the client reads it, then the end
        if hasattr(raw, "is_reading") and not raw.is_reading():
            raw.resume_reading()
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self._close_now)

    def _close_now(self) -> None:
        self.lingering = False
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if not self._raw.is_closing():
            self._raw.close()

    def _refuse_cut_short(self, cycle) -> None:
        declared = dict(cycle.scope.get("headers", ())).get(b"content-length")
        if declared is not None:
            what = f"its Content-Length ({declared.decode('latin-1')[:20]} bytes) says"
        else:
            what = "its chunked framing says (it ends with a last chunk, of size 0)"
        message = (f"the request body is shorter than {what}: the client closed its side of the connection before "
                   "sending the rest")
        client = getattr(self, "client", None)
        log.info("answering 400 to %s: %s", "%s:%d" % client if client else "a client", message)
        body = error(400, message).body
        self._raw.write(_BAD_REQUEST % (len(body), body))


def http_protocol(header_timeout: float, body_timeout: float, base=None) -> type:
    """uvicorn's HTTP protocol class (`base`, default the one `http="auto"` picks) with the read
    timeouts (seconds; serve/timeouts.py) and these connection edges: pass it as
    `uvicorn.Config(http=...)`."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base
    return type(f"Served{base.__name__}", (ConnectionEdges, ReadTimeouts, base),
                {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)})
