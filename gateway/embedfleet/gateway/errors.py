"""The gateway's own answers use the runtime's error shapes: {"error": {"message", "type", "code"}}, and on
Cohere's routes (/v2/*) Cohere's {"id", "message", "code"}, which its SDK hands to the caller.

Kept here rather than imported from the runtime, so that the gateway never imports the runtime's web
stack; the shape is the contract (the types mirror runtime/api/errors.py).
"""

from __future__ import annotations

import uuid

import orjson

from embedfleet.calls import JSON, Reply

TYPES = {
    400: "invalid_request_error", 404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
    409: "vector_space_mismatch", 422: "invalid_request_error", 429: "rate_limit_error", 502: "server_error",
    503: "service_unavailable", 504: "timeout_error",
}


class Refused(Exception):
    """An answer the gateway gives itself, without (or instead of) the upstream's."""

    def __init__(self, status: int, message: str, code: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


def error_body(status: int, message: str, code: str) -> bytes:
    return orjson.dumps({"error": {"message": message, "type": TYPES.get(status, "error"), "code": code}})


COHERE_PREFIX = "/v2/"


def error_reply(refused: Refused, cohere: bool = False) -> Reply:
    headers = [("content-type", JSON)]
    if refused.retry_after is not None:
        headers.append(("retry-after", str(refused.retry_after)))
    body = orjson.dumps({"id": str(uuid.uuid4()), "message": refused.message, "code": refused.code}) if cohere \
        else error_body(refused.status, refused.message, refused.code)
    return Reply(refused.status, body, headers)
