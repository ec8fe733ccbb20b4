"""Errors the gateway answers with, in OpenAI's body shape `{"error": {message, type, param, code}}`."""

from __future__ import annotations

from http import HTTPStatus

from pydantic import ValidationError

from services.gateway.openai_api import ErrorDetail, ErrorResponse
from shared.errors import describe_validation_error
from shared.protocol import ErrorInfo

RETRY_AFTER_S = 1
"""What a 429 tells the client to wait before retrying."""

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout",
}
_CODE_BY_STATUS = {
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}


class APIError(Exception):
    """An answer other than success: the HTTP status and what the body says."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        close_connection: bool = False,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPE_BY_STATUS.get(status) or _phrase(status)
        self.param = param
        self.code = code if code is not None else _CODE_BY_STATUS.get(status)
        self.close_connection = close_connection
        """Close the connection after the answer: the client's body was left unread."""

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S)} if self.status == 429 else {}

    def body(self) -> ErrorResponse:
        return ErrorResponse(
            error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code)
        )

    @classmethod
    def bad_request(cls, message: str, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_validation(cls, exc: ValidationError) -> APIError:
        """400 naming the offending field(s); `param` is the first one."""
        errors = exc.errors()
        param = ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None
        if errors and errors[0]["type"] == "json_invalid":
            return cls.bad_request(f"the body is not valid JSON: {errors[0]['msg']}")
        if errors and errors[0]["type"] == "model_type" and not errors[0]["loc"]:
            return cls.bad_request("the body must be a JSON object")
        # A whole-model check (no field) is named by the model's title: say just what is wrong.
        return cls.bad_request(describe_validation_error(exc).removeprefix(f"{exc.title}: "), param=param)

    @classmethod
    def from_mesh(cls, error: ErrorInfo) -> APIError:
        """A `TokenEvent.error` from the mesh, answered with the HTTP status it carries."""
        status = error.code if 400 <= error.code <= 599 else 500
        return cls(status, error.message, type=error.type or None)


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return "error"
