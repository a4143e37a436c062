"""The JSON document of a job: what GET /async/jobs/{id} answers and what a webhook receives.

The stored result is already JSON; it is spliced in as bytes, never parsed and re-encoded, because
a result of 64 vectors is a few hundred kilobytes.
"""

from __future__ import annotations

import orjson

from embedfleet.runtime.asyncq.store import text


def _seconds(fields: dict[str, bytes], name: str) -> float | None:
    value = fields.get(name)
    return round(float(value), 3) if value else None


def job_document(job_id: str, fields: dict[str, bytes]) -> bytes:
    status = text(fields.get("status", b"unknown"))
    head: dict[str, object] = {
        "id": job_id, "object": "async_job", "kind": text(fields.get("kind", b"embeddings")), "status": status,
        "created_at": _seconds(fields, "created_at"), "started_at": _seconds(fields, "started_at"),
        "finished_at": _seconds(fields, "finished_at"), "attempts": int(fields.get("attempts", b"0")),
    }
    retries = int(fields.get("retries", b"0"))
    if retries:  # sent back by transient conditions (queue full, OOM, draining); still on its way
        head["retries"] = retries
        head["retry_reason"] = text(fields.get("retry_reason", b""))
    if fields.get("webhook_url"):
        head["webhook"] = {"status": text(fields.get("webhook_status", b"waiting")),
                           "attempts": int(fields.get("webhook_attempts", b"0"))}
    if status == "failed":
        head["error"] = {"message": text(fields.get("error", b"")), "type": "job_failed", "code": "job_failed"}
    doc = orjson.dumps(head)
    result = fields.get("result")
    if status == "succeeded" and result:
        return doc[:-1] + b',"result":' + result + b"}"
    return doc
