"""What every dialect of the HTTP bridge answers with: ApiError (in OpenAI's,
Ollama's or Anthropic's error shape) and the two streamed encodings."""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any, Optional

from tandem.client.errors import DaemonGone, DaemonNotRunning, InvalidRequest, QueueFull, RequestFailed, TandemError
from tandem.protocol import ErrorCode

ANTHROPIC_TYPES = {  # Anthropic's error types by status
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


# The daemon's 1xx codes are the request's fault: 400. The others are ours.
_STATUS_OF_CODE = {
    ErrorCode.NOT_READY: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.SHUTTING_DOWN: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.WORKER_DIED: HTTPStatus.SERVICE_UNAVAILABLE,
    ErrorCode.DRAFTER_DIED: HTTPStatus.SERVICE_UNAVAILABLE,
}
_OPENAI_CODE = {  # where the API has a name for it
    ErrorCode.PROMPT_TOO_LONG: "context_length_exceeded",
}


class ApiError(Exception):
    """Answered as OpenAI's error shape: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: Optional[str] = None,
        code: Optional[str] = None,
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # sent with the answer (405's Allow)

    @property
    def type(self) -> str:
        if self.status == HTTPStatus.TOO_MANY_REQUESTS:
            return "rate_limit_error"
        if self.status >= 500:
            return "server_error"
        if self.status == HTTPStatus.NOT_FOUND:
            return "not_found_error"
        if self.status == HTTPStatus.UNAUTHORIZED:
            return "authentication_error"
        return "invalid_request_error"

    def body(self, dialect: str = "openai") -> dict:
        if dialect == "ollama":
            return {"error": self.message}
        if dialect == "anthropic":
            kind = ANTHROPIC_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def of(cls, exc: TandemError) -> "ApiError":
        if isinstance(exc, QueueFull):
            return cls(HTTPStatus.TOO_MANY_REQUESTS, f"the daemon's queue is full: {exc}", code="queue_full")
        if isinstance(exc, RequestFailed):
            try:
                code = ErrorCode(exc.code)
            except ValueError:
                code = ErrorCode.INTERNAL
            status = (
                HTTPStatus.BAD_REQUEST if code < 200 else _STATUS_OF_CODE.get(code, HTTPStatus.INTERNAL_SERVER_ERROR)
            )
            return cls(status, exc.message, code=_OPENAI_CODE.get(code, exc.name.lower()))
        if isinstance(exc, InvalidRequest):
            return cls(HTTPStatus.BAD_REQUEST, str(exc))
        if isinstance(exc, DaemonNotRunning):
            return cls(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="daemon_not_running")
        if isinstance(exc, DaemonGone):
            return cls(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="daemon_gone")
        return cls(HTTPStatus.BAD_GATEWAY, str(exc), code="daemon_error")


def json_bytes(obj: Any) -> bytes:
    """A JSON body as the bridge sends it (UTF-8, not escaped to ASCII)."""
    return json.dumps(obj, ensure_ascii=False).encode()


def ndjson(obj: Any) -> bytes:
    """One NDJSON line (Ollama's streams)."""
    return json_bytes(obj) + b"\n"


def sse(data: Any, event: Optional[str] = None) -> bytes:
    """One server-sent event (OpenAI's streams; Anthropic's, which name theirs)."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return (f"event: {event}\n" if event else "").encode() + f"data: {text}\n\n".encode()
