"""OpenAI-style error answers: every refusal carries `{"error": {message, type, param, code}}`, so
clients written for the OpenAI API show the message instead of failing to parse the body."""

from __future__ import annotations

import json

from fastapi.responses import Response

KINDS = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
         429: "rate_limit_error", 499: "invalid_request_error", 500: "server_error", 503: "server_error"}


def error(status: int, message: str, kind: str | None = None, param=None, headers=None) -> Response:
    """The error body as ASCII JSON: a field name or value echoed back may hold a lone surrogate."""
    body = {"error": {"message": message, "type": kind or KINDS.get(status, "invalid_request_error"),
                      "param": param, "code": None}}
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


class ApiError(Exception):
    """A request answered with an error status; raised anywhere below a route, turned into the
    response by the route (which also counts it)."""

    status = 400

    def __init__(self, message: str, param: str | None = None, status: int | None = None, headers=None):
        super().__init__(message)
        self.param = param
        self.headers = headers
        if status is not None:
            self.status = status

    def response(self) -> Response:
        return error(self.status, str(self), param=self.param, headers=self.headers)


class BadRequest(ApiError):
    status = 400
