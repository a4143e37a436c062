"""The hot routes, dispatched straight from the gate instead of through FastAPI's router.

A single short query costs the engine about 6 ms on two CPU cores (far less on a GPU), and FastAPI's
routing, dependency solving and exception middleware cost a few hundred microseconds of it on every
request, for routes that take the raw `Request` and build their own response anyway (api/http.py).
So the embedding routes run here, by exact method and path: the very same handler functions, which
stay registered with FastAPI too, so the OpenAPI document and any path this table does not name are
unchanged. Errors get the same shapes and counts as `errors.install` gives FastAPI's routes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from embedfleet.runtime.api import errors

log = logging.getLogger(__name__)
Handler = Callable[[Request], Awaitable[Response]]


class DirectRoutes:
    """ASGI: `routes[(method, path)]` handles the request itself; everything else goes to `app`."""

    def __init__(self, app, routes: dict[tuple[str, str], Handler], on_error: Callable[[int], None]) -> None:
        self.app = app
        self.routes = routes
        self.on_error = on_error

    async def __call__(self, scope, receive, send) -> None:
        handler = self.routes.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await handler(Request(scope, receive))
        except (errors.ApiError, *errors.DOMAIN_ERRORS) as exc:
            api = errors.as_api_error(exc)
            self.on_error(api.status)
            response = errors.error_response(api.status, api.message, api.code, api.headers)
        except RequestValidationError as exc:
            status, message, code = errors.describe_validation(exc)
            self.on_error(status)
            response = errors.error_response(status, message, code)
        except StarletteHTTPException:
            raise  # the gate's PayloadTooLarge: the gate answers it
        except ClientDisconnect:  # the client left mid-request: its business, not an error of ours
            log.info("client left during %s %s", scope["method"], scope["path"])
            return
        except Exception as exc:  # as errors.install's last handler: a 500 that names the kind, and the log
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            self.on_error(500)
            response = errors.error_response(500, f"internal error: {type(exc).__name__}", "internal_error")
        await response(scope, receive, send)
