"""Errors as the OpenAI API answers them: an HTTP status and the envelope
``{"error": {"message", "type", "param", "code"}}``.

Every refusal the server makes is an ``ApiError`` raised where the problem is found; the routes
turn it into its response. ``param`` names the request field at fault (dotted and indexed, e.g.
``messages[2].content``) whenever there is one, so a client can tell which value to change.
"""

from __future__ import annotations

import json

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
OVERLOADED = "overloaded_error"  # the queue is full, the model is loading, or the server is stopping
INTERNAL = "internal_error"


class ApiError(Exception):
    """A request refused (4xx) or failed (5xx), with what the client should be told."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,  # noqa: A002 - the envelope's own word
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def json_bytes(self) -> bytes:
        return json.dumps(self.body(), ensure_ascii=False).encode()


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request the server understood and refuses: a value of the wrong type or range."""
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, retry_after_s: int = 1, code: str | None = None) -> ApiError:
    """A 503 the client may retry (after ``Retry-After`` seconds)."""
    return ApiError(503, message, type=OVERLOADED, code=code, headers={"retry-after": str(retry_after_s)})


def internal() -> ApiError:
    """A 500: the traceback went to the server's stderr, never to the client."""
    return ApiError(500, "internal server error (the server's log has the details)", type=INTERNAL)
