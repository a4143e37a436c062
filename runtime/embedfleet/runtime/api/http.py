"""What every router shares: the JSON response, reading and checking a body, deadlines, running work.

A leaf of `api/`: the sync routers (routes_*.py), the async router (asyncq/routes.py) and `create_app`
all import from here and it imports none of them, so the two paths run the very same checks and map
the engine's refusals to the very same errors without an import cycle between them.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ValidationError
from starlette.responses import JSONResponse

from embedfleet.runtime.api import errors
from embedfleet.runtime.api.gate import ARRIVED, WHOLE, tenant_of
from embedfleet.runtime.core.jobs import DeadlineUnmet, QueueFull
from embedfleet.runtime.core.oom import is_out_of_memory
from embedfleet.runtime.core.tokenize import Tokenized
from embedfleet.runtime.service import ClientGone, ModelService, RunResult
from embedfleet.runtime.tenants import RequestOverQuota
from embedfleet.runtime.tracing import current_trace

log = logging.getLogger(__name__)
M = TypeVar("M", bound=BaseModel)


class JSON(JSONResponse):
    """orjson, numpy arrays included: vectors are serialised without a detour through Python floats. A
    JSONResponse, so that the OpenAPI document declares each route's `response_model` for its 200."""

    media_type = "application/json"

    def render(self, content) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


REQUEST_MODELS: dict[str, type[BaseModel]] = {}


def body_of(model: type[BaseModel]) -> dict:
    """OpenAPI for a body we parse ourselves (orjson, any content type) instead of via FastAPI."""
    REQUEST_MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def with_request_schemas(app: FastAPI) -> Callable[[], dict]:
    """`app.openapi` that also lists the models named by `body_of`: FastAPI never sees those bodies, so
    it would otherwise leave their `$ref`s dangling."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description,
                                 routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name, model in REQUEST_MODELS.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[name] = body
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


LIST_FIELDS = ("input", "inputs", "texts", "documents")  # the fields whose length is a request's batch size
TEXT_LIST_FIELDS = frozenset({"input", "inputs", "texts"})  # items are texts, token ids or token-id lists


def precheck(data: dict, max_client_batch: int) -> None:
    """Refuse an over-long or plainly malformed input list before pydantic sees it.

    A body of 20,000 `{}` items (60 KB) cost the event loop 0.29 s in full validation: the union
    `str | list[str] | list[int] | list[list[int]]` reports one error per item and branch. A length
    check and one isinstance per item cost well under a millisecond for the same body. A list of
    ints is one pre-tokenized input (its length is tokens, not inputs) and is left to validation.
    """
    for name in LIST_FIELDS:
        items = data.get(name)
        if not isinstance(items, list) or not items or isinstance(items[0], int):
            continue
        if len(items) > max_client_batch:
            raise errors.ApiError(413, f"batch of {len(items)} inputs is over the limit of {max_client_batch} per "
                                  "request (--max-client-batch-size); split it", "batch_too_large")
        if name in TEXT_LIST_FIELDS:
            bad = next((i for i, x in enumerate(items) if not isinstance(x, str | list)), None)
            if bad is not None:
                raise errors.ApiError(422, f"invalid request: {name}.{bad}: must be a text or a list of token ids, "
                                      f"not {type(items[bad]).__name__}", "invalid_request")


async def load_json(request: Request, max_client_batch: int | None = None) -> dict:
    """The body as a JSON object, whatever the content type says; with `max_client_batch`, prechecked."""
    try:
        data = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise errors.ApiError(400, f"malformed JSON body: {exc}", "invalid_json") from None
    if not isinstance(data, dict):
        raise errors.ApiError(422, f"the body must be a JSON object, not {type(data).__name__}", "invalid_request")
    if max_client_batch is not None:
        precheck(data, max_client_batch)
    return data


def validate(data: dict, model: type[M]) -> M:
    """As FastAPI would have validated it, so a bad body gets FastAPI's 422 shape (errors.install)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


async def parse(request: Request, model: type[M], max_client_batch: int | None = None) -> M:
    return validate(await load_json(request, max_client_batch), model)


def deadline_of(request: Request, body_timeout: float | None) -> float | None:
    """The request's deadline as a time.monotonic() value, from `X-Request-Timeout` (seconds, counted
    from when the gate accepted the request) or the body's `timeout`, whichever is sooner."""
    raw = request.headers.get("x-request-timeout")
    timeouts = [body_timeout] if body_timeout is not None else []
    if raw is not None:
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not math.isfinite(value) or value <= 0:
            raise errors.ApiError(422, f"X-Request-Timeout must be a positive number of seconds, not {raw!r}",
                                  "invalid_timeout")
        timeouts.append(value)
    if not timeouts:
        return None
    arrived = request.scope.get(ARRIVED, time.monotonic())
    return arrived + min(timeouts)


def is_bulk(request: Request) -> bool:
    """`X-Priority: bulk` marks a request as bulk whatever its size; other values change nothing (a
    client cannot promote a large request past others)."""
    return request.headers.get("x-priority", "").strip().lower() == "bulk"


async def wait_disconnect(receive) -> None:
    """Resolves when the client closes its connection (the body is already read by then)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def run(svc: ModelService, tokenized: list[Tokenized], request: Request,
              body_timeout: float | None) -> RunResult:
    """Admission by expected wait and the deadline, then the engine (core/admission.py).

    Every sync route ends here, so a condition of the replica (full queue, unmeetable deadline, out of
    memory) is the same 429/503/504 with the same code on all of them, never a 500.
    """
    deadline = deadline_of(request, body_timeout)
    urgent = svc.is_urgent(len(tokenized), is_bulk(request))
    try:
        result = await svc.run(tokenized, partial(wait_disconnect, request.receive), urgent=urgent, bounded=True,
                               deadline=deadline, tenant=tenant_of(request.scope),
                               arrived=request.scope.get(WHOLE, request.scope.get(ARRIVED)))
        trace = current_trace()
        if trace is not None:
            trace.encoding()
        return result
    except ClientGone:
        log.debug("client went away; its queued inputs were dropped")
        raise errors.ApiError(499, "client closed the request", "client_closed") from None
    except DeadlineUnmet as exc:
        raise errors.ApiError(504, str(exc), "deadline_exceeded") from None
    except QueueFull as exc:
        # A condition of this replica (or the tenant's quota) now, not of the request: say when to come
        # back, never 500.
        raise errors.ApiError(429, str(exc), "quota_exceeded" if exc.reason == "quota" else "overloaded",
                              {"retry-after": str(max(1, math.ceil(exc.retry_after)))}) from None
    except RequestOverQuota as exc:
        raise errors.ApiError(413, str(exc), "over_quota") from None
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        log.warning("engine out of memory on a batch: %s", exc)
        raise errors.ApiError(503, "the engine ran out of memory on this batch; retry shortly (a smaller "
                              "batch may fit)", "out_of_memory", {"retry-after": "1"}) from None
