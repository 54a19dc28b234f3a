"""Read timeouts for uvicorn's HTTP connections: a client that sends half its headers, or fewer
body bytes than its Content-Length declares, is cut off instead of holding a connection (and, for
a body, a request being read) forever. uvicorn times out only idle keep-alive connections.

Two deadlines, each from the moment its part begins: `header_timeout` from the connection (or a
kept-alive connection's next request's first byte) to the last header, `body_timeout` from the
last header to the last body byte. When one passes, the client gets a 408 (if no answer has
begun) and the connection is closed; a request whose body was being read then sees its client
gone (counted as 499). A request read in full is never timed out here: generating may take long.

The timeouts are a mixin over the HTTP protocol class uvicorn would pick (h11, httptools, zttp):
it reads only what those share (`cycle`, `cycle.more_body`, `cycle.response_complete`,
`cycle.response_started`, `transport`, `loop`, `on_response_complete`)."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s")


class ReadTimeouts:
    """Mixed in before a uvicorn HTTP protocol class (see `timed_protocol`)."""

    header_timeout: float = 30.0
    body_timeout: float = 60.0

    _timer: asyncio.TimerHandle | None = None
    _timing: tuple | None = None  # (part, the cycle it belongs to): which deadline runs

    # ------------------------------------------------------------ the protocol's events
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(("headers", None), self.header_timeout)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow(between_requests=True)

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    # ------------------------------------------------------------ deadlines
    def _follow(self, between_requests: bool = False) -> None:
        """Arm the deadline of the part being read now, keep the running one, or stop timing."""
        cycle = getattr(self, "cycle", None)
        if cycle is None or cycle.response_complete:
            # bytes of a next request (or of the body of one already answered): its headers are due;
            # right after an answer, nothing is read yet (uvicorn's keep-alive timeout applies)
            part = None if between_requests else ("headers", cycle)
        elif cycle.more_body:
            part = ("body", cycle)
        else:
            part = None  # read in full: the app is answering
        if part is None:
            self._disarm()
        elif part != self._timing:
            self._arm(part, self.header_timeout if part[0] == "headers" else self.body_timeout)

    def _arm(self, part, seconds: float) -> None:
        self._disarm()
        self._timing = part
        self._timer = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._timing = None

    def _expired(self) -> None:
        part, cycle = self._timing or ("headers", None)
        self._timer = self._timing = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        seconds, flag = ((self.header_timeout, "--header-timeout") if part == "headers"
                         else (self.body_timeout, "--body-timeout"))
        client = getattr(self, "client", None)
        log.info("closing the connection of %s: its request %s did not arrive within %g s (%s)",
                 "%s:%d" % client if client else "a client", part, seconds, flag)
        if cycle is None or cycle.response_complete or not cycle.response_started:
            message = (f'{{"error": {{"message": "the request {part} did not arrive within {seconds:g} s ({flag}): '
                       f'send the whole request at once", "type": "invalid_request_error", "param": null, '
                       f'"code": null}}}}').encode()
            transport.write(_TIMEOUT % (len(message), message))
        transport.close()


def timed_protocol(header_timeout: float, body_timeout: float, base=None) -> type:
    """uvicorn's HTTP protocol class (`base`, default the one `http="auto"` picks) with these read
    timeouts (seconds): pass it as `uvicorn.Config(http=...)`."""
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol as base
    return type(f"Timed{base.__name__}", (ReadTimeouts, base),
                {"header_timeout": float(header_timeout), "body_timeout": float(body_timeout)})
