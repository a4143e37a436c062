"""One error shape for every route: {"error": {"message", "type", "code"}}.

OpenAI's SDK reads `error.message`; TEI clients read `error` as text, which still shows the dict.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from embedfleet.runtime.core.jobs import EngineUnavailable, RequestTooLarge

log = logging.getLogger(__name__)

TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 422: "invalid_request_error",
    429: "rate_limit_error", 500: "server_error", 503: "service_unavailable", 504: "timeout_error",
}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}
        self.code = code or TYPES.get(status, "error")


def error_body(status: int, message: str, code: str | None = None, kind: str | None = None) -> bytes:
    """`kind`: the error type where the status alone does not say it (409 vector_space_mismatch)."""
    return orjson.dumps({"error": {"message": message, "type": kind or TYPES.get(status, "error"),
                                   "code": code or str(status)}})


def error_response(status: int, message: str, code: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    return Response(error_body(status, message, code), status_code=status, headers=headers,
                    media_type="application/json")


def _loc(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    return ".".join(parts) or "body"


def describe_validation(exc: RequestValidationError) -> tuple[int, str, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        return 400, f"malformed JSON body: {detail.get('ctx', {}).get('error', detail.get('msg'))}", "invalid_json"
    # A union (e.g. `input: str | list[str] | ...`) reports one error per branch; show the first few.
    shown = "; ".join(f"{_loc(tuple(e['loc']))}: {e['msg']}" for e in errors[:3])
    more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
    return 422, f"invalid request: {shown}{more}", "invalid_request"


# Conditions the layers below HTTP raise without knowing it (split serving's link to the engine process),
# answered alike wherever a route meets them: here for FastAPI's routes, in api/direct.py for the hot ones.
DOMAIN_ERRORS = (EngineUnavailable, RequestTooLarge)


def as_api_error(exc: Exception) -> ApiError:
    """The answer to an ApiError or one of DOMAIN_ERRORS."""
    if isinstance(exc, EngineUnavailable):  # the engine process died or is restarting
        return ApiError(503, str(exc), "engine_unavailable", {"retry-after": "1"})
    if isinstance(exc, RequestTooLarge):  # over what one frame to the engine process carries
        return ApiError(413, str(exc), "too_large")
    assert isinstance(exc, ApiError), exc
    return exc


def install(app, on_error) -> None:
    """Map every failure to the one shape; `on_error(status)` counts it."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        on_error(exc.status)
        return error_response(exc.status, exc.message, exc.code, exc.headers)

    async def _domain(_: Request, exc: Exception) -> Response:
        api = as_api_error(exc)
        on_error(api.status)
        return error_response(api.status, api.message, api.code, api.headers)

    for kind in DOMAIN_ERRORS:
        app.add_exception_handler(kind, _domain)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        status, message, code = describe_validation(exc)
        on_error(status)
        return error_response(status, message, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        on_error(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _left(request: Request, _: ClientDisconnect) -> Response:
        log.info("client left during %s %s", request.method, request.url.path)
        return Response(status_code=499)  # nginx's "client closed request"; nobody reads it

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        on_error(500)
        return error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
