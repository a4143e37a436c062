"""A stand-in runtime for the gateway's tests (a real process on loopback): it reports whatever
load a test sets and logs every work request it gets, so routing can be checked exactly.

`GET /load` and every answer's `x-embedfleet-expected-wait` report `expected_wait`; work requests
sleep `delay` seconds, then answer 200 with the stub's name (its head `head_first` seconds before its
body, when that is set), or 503 `draining` while `draining` is
set (without running them, like the runtime), or `fail_status` (e.g. 500) while that is set. POST
/_control changes those settings; GET /_log lists the work requests received (path, model, the
headers the gateway passed down, the body's `tag`).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import orjson
from aiohttp import web

LOGGED_HEADERS = ("authorization", "x-priority", "x-request-id", "x-request-timeout", "content-type")


def make_app(name: str, model: str, expected_wait: float, delay: float) -> web.Application:
    state = {"expected_wait": expected_wait, "delay": delay, "draining": False, "status": "ready", "fail_status": 0,
             "head_first": 0.0}
    log: list[dict] = []
    in_flight = 0

    def load_headers() -> dict[str, str]:
        return {"x-embedfleet-expected-wait": f"{state['expected_wait']:.4f}"}

    async def load(request: web.Request) -> web.Response:
        status = "draining" if state["draining"] else state["status"]
        return web.json_response({"ready": status == "ready", "status": status, "draining": state["draining"],
                                  "in_flight": in_flight,
                                  "models": {model: {"queue_tokens": 0, "tokens_per_s": 1000.0,
                                                     "expected_wait_s": state["expected_wait"]}}})

    async def ready(request: web.Request) -> web.Response:
        ok = state["status"] == "ready" and not state["draining"]
        return web.json_response({"status": state["status"]}, status=200 if ok else 503)

    async def control(request: web.Request) -> web.Response:
        state.update(await request.json())
        return web.json_response(state)

    async def get_log(request: web.Request) -> web.Response:
        return web.json_response(log)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model", "owned_by": name}]})

    async def work(request: web.Request) -> web.Response:
        nonlocal in_flight
        started = time.monotonic()
        raw = await request.read()
        doc = orjson.loads(raw) if raw else {}
        entry = {"path": request.path, "model": doc.get("model"), "tag": doc.get("tag"),
                 "headers": {h: request.headers[h] for h in LOGGED_HEADERS if h in request.headers},
                 "refused": state["draining"]}
        log.append(entry)
        if state["draining"]:
            body = {"error": {"message": "the server is draining", "type": "service_unavailable",
                              "code": "draining"}}
            return web.json_response(body, status=503, headers={"retry-after": "1", "connection": "close"})
        if state["fail_status"]:
            body = {"error": {"message": "the stub was told to fail", "type": "server_error", "code": "stub_failure"}}
            return web.json_response(body, status=state["fail_status"])
        in_flight += 1
        try:
            await asyncio.sleep(state["delay"])
        finally:
            in_flight -= 1
        took = (time.monotonic() - started) * 1000
        headers = {**load_headers(), "server-timing": f"total;dur={took:.2f}"}
        answer = orjson.dumps({"served_by": name, "tag": doc.get("tag")})
        if state["head_first"]:  # the head, then the body this many seconds later: two packets
            response = web.StreamResponse(headers={**headers, "content-type": "application/json"})
            response.content_length = len(answer)
            await response.prepare(request)
            await asyncio.sleep(state["head_first"])
            await response.write(answer)
            await response.write_eof()
            return response
        return web.Response(body=answer, content_type="application/json", headers=headers)

    app = web.Application()
    app.router.add_get("/load", load)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/_control", control)
    app.router.add_get("/_log", get_log)
    app.router.add_post("/{tail:.*}", work)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--name", default="stub")
    p.add_argument("--model", default="stub-model")
    p.add_argument("--expected-wait", type=float, default=0.0)
    p.add_argument("--delay", type=float, default=0.0)
    a = p.parse_args()
    web.run_app(make_app(a.name, a.model, a.expected_wait, a.delay), host=a.host, port=a.port,
                print=None, access_log=None)


if __name__ == "__main__":
    main()
