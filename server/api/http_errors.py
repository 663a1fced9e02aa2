"""OpenAI-shaped error responses and the exception → status mapping.

Bad input is always a 4xx with a message naming the field; only a bug in the server is a 500, which
error_boundary.py answers.
"""
from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metronome.contract.errors import (
    EngineDrainingError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelNotFoundError,
)

log = logging.getLogger("metronome.api")

# OpenAI's error `type`s (its error-codes guide): a request the client must change is "invalid_request_error"
# whatever the status (an unknown model is 404 with code "model_not_found", a bad key 401 with code
# "invalid_api_key"); "rate_limit_error" for 429, "service_unavailable_error" for 503, else "server_error".
_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": printable(message), "type": _TYPE_BY_STATUS.get(status, "server_error"),
                      "param": None if param is None else printable(param), "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def printable(text: str) -> str:
    """`text` with anything UTF-8 cannot encode (a lone surrogate from the request) written as an escape, so
    that an error about bad text can itself be sent."""
    return text if text.isascii() else text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe_validation_error(exc: RequestValidationError, limit: int = 3) -> tuple[str, str | None]:
    """A short message naming the fields at fault, and the first field as `param`."""
    parts: list[str] = []
    first_param: str | None = None
    for item in exc.errors():
        loc = [str(p) for p in item.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        where = ".".join(loc) or "body"
        if first_param is None:
            first_param = where
        part = f"{where}: {_plain(item.get('msg', 'invalid'))}"
        if part not in parts:
            parts.append(part)
    shown = "; ".join(parts[:limit])
    if len(parts) > limit:
        shown += f"; and {len(parts) - limit} more"
    return shown or "invalid request body", first_param


def _plain(message: str) -> str:
    """pydantic prefixes the messages of our own validators with "Value error, "."""
    return message.removeprefix("Value error, ")


def _is_union_tag(part) -> bool:
    """pydantic names the member of a union it tried (`str`, `list[int]`, ...); users never wrote it."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none"} or "[" in part)


def retry_after_header(seconds: float) -> str:
    return str(max(1, math.ceil(seconds)))


def install_error_handlers(app: FastAPI, on_reject=lambda reason: None) -> None:
    """`on_reject(reason)` counts API-level rejections the engine never saw."""

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation_error(exc)
        on_reject("invalid")
        return error_response(400, message, param=param, code="invalid_value")

    @app.exception_handler(InvalidRequestError)
    async def _invalid(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, str(exc), param=exc.param, code="invalid_value")

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError) -> JSONResponse:
        # Only a client's nesting (a schema, a message list inside lists) goes this deep while a request is read.
        on_reject("invalid")
        return error_response(400, "the request body nests too deeply to be processed", code="invalid_value")

    @app.exception_handler(ModelNotFoundError)
    async def _model(request: Request, exc: ModelNotFoundError) -> JSONResponse:
        on_reject("invalid")
        return error_response(404, str(exc), param="model", code="model_not_found")

    @app.exception_handler(EngineOverloadedError)
    async def _overloaded(request: Request, exc: EngineOverloadedError) -> JSONResponse:
        return error_response(429, str(exc), code=getattr(exc, "code", "overloaded"),
                              headers={"Retry-After": retry_after_header(exc.retry_after_seconds)})

    @app.exception_handler(EngineDrainingError)
    async def _draining(request: Request, exc: EngineDrainingError) -> JSONResponse:
        on_reject("draining")
        return error_response(503, str(exc), code="draining", headers={"Connection": "close", "Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
