"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: the
exception handlers raise through (`ApiError`), the app's handlers for FastAPI's own
errors, and the answer to a request the engine ended with an error (docs/server.md,
"Errors").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

if TYPE_CHECKING:
    from .handle import Finished


class ApiError(Exception):
    """An error answered in OpenAI's shape; raise it anywhere a handler runs."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code

    def response(self) -> JSONResponse:
        """The error as an OpenAI-shaped JSON answer."""
        return error_response(self.status, self.message, self.type, self.param, self.code)


def error_type(status: int) -> str:
    """The OpenAI error type of an HTTP status."""
    return "invalid_request_error" if status < 500 else "server_error"


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None) -> JSONResponse:
    """An OpenAI-shaped JSON error answer (WWW-Authenticate on a 401)."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return JSONResponse({"error": {"message": message, "type": type_, "param": param,
                                   "code": code}}, status_code=status, headers=headers)


def finished_error(fin: Finished) -> JSONResponse:
    """The answer to a request the engine ended with an error."""
    resp = error_response(fin.status, fin.error or "the request failed", error_type(fin.status),
                          "max_tokens" if fin.code == "context_length_exceeded" else None,
                          fin.code)
    if fin.retry_after_s is not None:
        resp.headers["Retry-After"] = str(fin.retry_after_s)
    return resp


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """A 400 for a body pydantic refused: the first few problems, and the first one's field."""
    errs = exc.errors()
    parts = []
    for e in errs[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON (at character {loc}): "
                         f"{e.get('ctx', {}).get('error', e.get('msg', ''))}")
        else:
            parts.append(f"{loc or 'body'}: {e.get('msg', 'invalid')}")
    param = None
    if errs and errs[0].get("type") != "json_invalid":  # its loc is a char offset
        where = [str(x) for x in errs[0].get("loc", ()) if x != "body"]
        param = where[0] if where else None
    return error_response(400, "; ".join(parts) or "invalid request", param=param)


def add_error_handlers(app: FastAPI, count_rejected: Callable[[int], None]) -> None:
    """Answer ApiError, invalid bodies and FastAPI's own HTTP errors in OpenAI's shape.

    FastAPI's errors are an unknown path, a wrong method; each refusal is counted by status."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        count_rejected(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        count_rejected(400)
        return validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        count_rejected(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), error_type(exc.status_code))
