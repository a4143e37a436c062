"""The runtime application's ASGI lifespan, run by `embedfleet serve` itself rather than by the HTTP
server: start-up (the models load in the background) before the socket opens, shutdown after it closes,
and a failure of either raised here with the application's own message."""

from __future__ import annotations

import asyncio

ASGI = {"version": "3.0", "spec_version": "2.3"}


class Lifespan:
    """The application's ASGI lifespan: `startup()` before serving, `shutdown()` after."""

    def __init__(self, app) -> None:
        self.app = app
        self._in: asyncio.Queue[dict] = asyncio.Queue()
        self._out: asyncio.Queue[dict] = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def _expect(self, step: str) -> None:
        assert self._task is not None
        getter = asyncio.ensure_future(self._out.get())
        done, _ = await asyncio.wait({getter, self._task}, return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
            getter.cancel()
            self._task.result()  # the application failed: raise its error
            raise RuntimeError(f"the application ended its lifespan before {step}")
        message = getter.result()
        if message["type"] == f"lifespan.{step}.failed":
            raise RuntimeError(f"application {step} failed: {message.get('message', '')}")

    async def startup(self) -> None:
        self._task = asyncio.create_task(self.app({"type": "lifespan", "asgi": ASGI, "state": {}}, self._in.get,
                                                  self._out.put))
        await self._in.put({"type": "lifespan.startup"})
        await self._expect("startup")

    async def shutdown(self) -> None:
        if self._task is None or self._task.done():
            return
        await self._in.put({"type": "lifespan.shutdown"})
        await self._expect("shutdown")
        await self._task
