"""Errors as the OpenAI API writes them: `{"error": {"message", "type", "param", "code"}}` with a status."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

# the error type and code a status gets when nothing more precise is said
DEFAULTS: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "queue_full"),
    500: ("server_error", "internal_error"),
    503: ("server_error", "server_busy"),
}


class ApiError(Exception):
    """A request the server answers with an error status and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, code: str | None = None, error_type: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        default_type, default_code = DEFAULTS.get(status, ("invalid_request_error", "error"))
        self.status = status
        self.message = message
        self.code = code or default_code
        self.error_type = error_type or default_type
        self.param = param
        self.headers = headers

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        """The error as a response."""
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def status_error(status: int, detail: Any) -> ApiError:
    """An ApiError for a status Starlette raised itself (an unknown route, a method not allowed)."""
    message = detail if isinstance(detail, str) and detail else f"HTTP {status}"
    if status == 404:
        message = "unknown route; this server has /v1/chat/completions, /v1/models, /health and /metrics"
    return ApiError(status, message)
