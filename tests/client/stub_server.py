"""A deliberately misbehaving embedding server for the client's tests (a real process on loopback).

Faults are queued with POST /_control and consumed by the next matching work requests, so a test
says exactly what goes wrong and when ("the next 2 requests get 500"). GET /_stats returns how many
work requests arrived and a log of them (arrival time, route, batch size, fault applied).

Vectors are a pure function of the text (`vector_for`), so tests compute expected rows themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import time
import zlib
from typing import Any

import numpy as np
import orjson
from aiohttp import web

FULL_DIM = 16


def vector_for(text: str, dim: int = FULL_DIM) -> np.ndarray:
    rng = np.random.default_rng(zlib.crc32(text.encode()))
    return rng.standard_normal(FULL_DIM).astype(np.float32)[:dim]


def score_for(query: str, text: str) -> float:
    words = set(query.lower().split())
    overlap = sum(1 for w in text.lower().split() if w in words)
    return overlap + (zlib.crc32(text.encode()) % 1000) / 10_000


class State:
    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.faults: list[dict[str, Any]] = []
        self.log: list[dict[str, Any]] = []
        self.health_status = 200
        self.health_delay = 0.0
        self.classify_route = "classify"

    def take_fault(self) -> dict[str, Any] | None:
        for fault in self.faults:
            if fault.get("times", 1) != 0:
                if fault.get("times", 1) > 0:
                    fault["times"] -= 1
                return fault
        return None


def _json(doc: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(doc), status=status, content_type="application/json", headers=headers
    )


def make_app() -> web.Application:
    state = State()

    async def apply_fault(
        request: web.Request, route: str, n: int
    ) -> web.StreamResponse | dict[str, Any] | None:
        fault = state.take_fault()
        state.log.append({"t": time.monotonic(), "route": route, "n": n, "fault": fault and fault["kind"]})
        if fault is None:
            return None
        kind = fault["kind"]
        if kind == "slow":
            await asyncio.sleep(fault.get("delay", 1.0))
            return None
        if kind == "status":
            headers = {"Retry-After": str(fault["retry_after"])} if "retry_after" in fault else None
            code = fault.get("status", 500)
            err = {"message": fault.get("message", f"injected {code}"), "type": "injected", "code": code}
            return _json({"error": err}, status=code, headers=headers)
        if kind == "drop":
            assert request.transport is not None
            request.transport.abort()
            await asyncio.sleep(0.05)
            return web.Response(status=500)
        return fault  # shape faults are applied by the route

    async def embeddings(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        texts = body["input"]
        texts = [texts] if isinstance(texts, str) else texts
        early = await apply_fault(request, "embeddings", len(texts))
        if isinstance(early, web.StreamResponse):
            return early
        dim = int(body.get("dimensions") or FULL_DIM)
        vecs = [vector_for(t, dim) for t in texts]
        if early and early["kind"] == "wrong_count":
            vecs = vecs[:-1]
        if early and early["kind"] == "wrong_dim":
            vecs[-1] = vecs[-1][:-1]
        if early and early["kind"] == "bad_json":
            return web.Response(body=b'{"data": [', content_type="application/json")
        b64 = body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if b64 else v.tolist(),
            }
            for i, v in enumerate(vecs)
        ]
        data.reverse()  # order by `index`, never by position: a client must not rely on it
        tokens = sum(len(t.split()) for t in texts)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return _json({"object": "list", "data": data, "model": body.get("model") or "stub", "usage": usage})

    async def rerank(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        early = await apply_fault(request, "rerank", len(body["texts"]))
        if isinstance(early, web.StreamResponse):
            return early
        rows = [
            {
                "index": i,
                "score": score_for(body["query"], t),
                **({"text": t} if body.get("return_text") else {}),
            }
            for i, t in enumerate(body["texts"])
        ]
        rows.sort(key=lambda r: -r["score"])
        return _json(rows)

    def labels(text: str) -> list[dict[str, Any]]:
        p = (zlib.crc32(text.encode()) % 1000) / 1000
        return sorted(
            [{"label": "positive", "score": p}, {"label": "negative", "score": 1 - p}],
            key=lambda x: -x["score"],
        )

    async def classify(request: web.Request) -> web.StreamResponse:
        if state.classify_route != "classify":
            return _json({"error": {"message": "Not Found", "type": "not_found", "code": 404}}, status=404)
        body = orjson.loads(await request.read())
        early = await apply_fault(request, "classify", len(body["input"]))
        if isinstance(early, web.StreamResponse):
            return early
        return _json({"data": [{"index": i, "labels": labels(t)} for i, t in enumerate(body["input"])]})

    async def predict(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        early = await apply_fault(request, "predict", len(body["inputs"]))
        if isinstance(early, web.StreamResponse):
            return early
        return _json([labels(t) for t in body["inputs"]])

    async def health(_request: web.Request) -> web.StreamResponse:
        if state.health_delay:
            await asyncio.sleep(state.health_delay)
        return _json({"status": "ok" if state.health_status < 400 else "down"}, status=state.health_status)

    async def control(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        if body.get("reset"):
            state.reset()
        state.faults.extend(body.get("faults", []))
        for key in ("health_status", "health_delay", "classify_route"):
            if key in body:
                setattr(state, key, body[key])
        return _json({"ok": True})

    async def stats(_request: web.Request) -> web.StreamResponse:
        return _json({"count": len(state.log), "log": state.log})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/rerank", rerank)
    app.router.add_post("/classify", classify)
    app.router.add_post("/predict", predict)
    app.router.add_get("/health", health)
    app.router.add_post("/_control", control)
    app.router.add_get("/_stats", stats)
    return app


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    web.run_app(make_app(), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
