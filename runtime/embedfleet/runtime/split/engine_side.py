"""The engine process's end of the link: fronts' token ids in, through each model's own `ModelService.run`
(tenant quota, admission by expected wait, deadline, batching, preemption: unchanged), vectors out.

One connection per front. A request whose front disconnects is dropped like one whose client left (its
queued inputs never run). Every `STATE_S` the engine's load goes out to each front that has not seen it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from dataclasses import dataclass, field

import numpy as np

from embedfleet.runtime.core.jobs import DeadlineUnmet, QueueFull
from embedfleet.runtime.core.multivector import Marked
from embedfleet.runtime.core.oom import is_out_of_memory
from embedfleet.runtime.core.tokenize import Tokenized
from embedfleet.runtime.metrics import refresh_tracked
from embedfleet.runtime.service import ClientGone, Models
from embedfleet.runtime.split import link
from embedfleet.runtime.tenants import RequestOverQuota
from embedfleet.runtime.timing import RequestTiming
from embedfleet.runtime.tracing import RequestTrace, RuntimeTracing

log = logging.getLogger(__name__)
STATE_S = 0.05  # how stale a front's view of the engine's load may be (it only refuses early on it)
PEERCRED = struct.Struct("3i")


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket, as the kernel saw it connect."""
    return PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))[1]


def state_of(models: Models) -> dict:
    """What fronts need of the engine's state: loaded or failed, and per model the figures the gate and
    /ready, /load read (and the batch limits, which on a GPU the engine sizes at load)."""
    report: dict = {}
    for name, s in models.services.items():
        if s.batcher is None:
            continue
        b = s.batcher
        report[name] = {"urgent_wait": round(b.expected_wait(urgent=True), 4),
                        "bulk_wait": round(b.expected_wait(urgent=False), 4), "saturated": b.saturated,
                        "queued_tokens": b.queued_tokens, "tokens_per_s": round(b.tokens_per_s, 1),
                        "max_batch_tokens": s.settings.max_batch_tokens,
                        "max_batch_requests": s.settings.max_batch_requests, "vector_space": s.vector_space,
                        "fingerprint": s.fingerprint, "effective_dtype": s.effective_dtype,
                        "probe": s.probe_status}
    return {"loaded": models.loaded, "load_error": models.load_error, "models": report,
            "startup": models.startup_report()}


def inputs_of(sub: link.Submitted) -> list[Tokenized] | list[Marked]:
    """The engine inputs of a SUBMIT: what the front's route built (Tokenized, or ColBERT's Marked)."""
    types = sub.type_ids
    if sub.attended is not None:
        return [Marked(row, bool(length > len(row)), attended if attended >= 0 else None,
                       types[i] if types is not None else None)
                for i, (row, length, attended) in enumerate(zip(sub.ids, sub.original_lengths.tolist(),
                                                                sub.attended.tolist(), strict=True))]
    if types is None:
        return list(map(Tokenized, sub.ids, sub.original_lengths.tolist()))
    return list(map(Tokenized, sub.ids, sub.original_lengths.tolist(), types))


@dataclass(eq=False)
class _Front:
    writer: asyncio.StreamWriter
    gone: dict[int, asyncio.Event] = field(default_factory=dict)  # request id -> set when the client left
    sent_state: bytes = b""

    def send(self, data: bytes) -> None:
        if not self.writer.is_closing():
            self.writer.write(data)


class LinkServer:
    """Serves fronts on a Unix socket at `path` (in a directory only this user can enter)."""

    def __init__(self, models: Models, path: str, tracing: RuntimeTracing | None = None) -> None:
        self.models = models
        self.path = path
        self.tracing = tracing  # --otel: a traced front request's engine spans join its trace
        self.fronts: set[_Front] = set()
        self._server: asyncio.AbstractServer | None = None
        self._pusher: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._server = await asyncio.start_unix_server(self._serve, self.path, limit=2**20)
        os.chmod(self.path, 0o600)
        self._pusher = asyncio.get_running_loop().create_task(self._push_state())

    async def stop(self) -> None:
        if self._pusher is not None:
            self._pusher.cancel()
        if self._server is not None:
            self._server.close()
        for front in list(self.fronts):
            front.writer.close()

    async def _push_state(self) -> None:
        while True:
            refresh_tracked()  # this engine's queue gauges, which another engine may be the one to expose
            if self.fronts:
                snapshot = link.frame(link.STATE, link.orjson.dumps(state_of(self.models)))
                for front in list(self.fronts):
                    if front.sent_state != snapshot:
                        front.sent_state = snapshot
                        front.send(snapshot)
            await asyncio.sleep(STATE_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        if sock is None or peer_uid(sock) != os.getuid():
            log.warning("a connection to the engine link from another user; closed")
            writer.close()
            return
        front = _Front(writer)
        self.fronts.add(front)
        try:
            while True:
                kind, body = await link.read_frame(reader, link.MAX_REQUEST_FRAME)
                if kind == link.SUBMIT:
                    sub = link.read_submit(body)
                    # registered now, not in the task: a CANCEL read right after its SUBMIT must find it
                    front.gone[sub.request_id] = asyncio.Event()
                    self._spawn(self._submit(front, sub))
                elif kind == link.CANCEL:
                    event = front.gone.get(link.ID.unpack(body)[0])
                    if event is not None:
                        event.set()
                elif kind == link.CALL:
                    request_id = link.ID.unpack_from(body)[0]
                    self._spawn(self._call(front, request_id, link.read_json(body, link.ID.size)))
                else:
                    raise link.WireError(f"a front sent a frame of kind {kind}")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except link.WireError as exc:
            log.error("a front broke the link's format (%s); its connection is closed", exc)
        finally:
            self.fronts.discard(front)
            for event in front.gone.values():  # the front is gone: so are its clients
                event.set()
            writer.close()

    def _trace_of(self, carrier: object, model: str) -> RequestTrace | None:
        """The front's request trace continued here (--otel), or None: not traced, or a carrier that does not
        parse (never a reason to fail the request)."""
        if self.tracing is None or not isinstance(carrier, dict):
            return None
        try:
            trace = self.tracing.continued({str(k): str(v) for k, v in carrier.items()})
        except Exception:  # a malformed context loses the spans, not the request
            log.debug("a front's trace context did not parse", exc_info=True)
            return None
        if trace is not None:
            trace.model = model  # the batch span names it (a front's trace learnt it at tokenization)
        return trace

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _submit(self, front: _Front, sub: link.Submitted) -> None:
        request_id, meta = sub.request_id, sub.meta
        gone = front.gone[request_id]
        svc = self.models.services.get(str(meta.get("model")))
        tenant = None
        if meta.get("tenant") is not None:
            tenant = self.models.tenants.all.get(str(meta["tenant"]))
            if tenant is None:  # fail closed: a keys file changed under one process and not the other
                front.gone.pop(request_id, None)
                front.send(link.error(request_id, "unavailable", f"tenant {meta['tenant']!r} is not known to the "
                                      "engine process (the keys file changed); retry shortly"))
                return
        if svc is None or not svc.loaded:
            front.gone.pop(request_id, None)
            front.send(link.error(request_id, "unavailable", f"model {meta.get('model')!r} is not loaded"))
            return
        tokenized = inputs_of(sub)
        timing = RequestTiming().begin()
        trace = self._trace_of(meta.get("trace"), svc.name)
        try:
            result = await svc.run(tokenized, gone.wait, urgent=meta.get("urgent"), bounded=bool(meta.get("bounded")),
                                   deadline=meta.get("deadline"), tenant=tenant, arrived=meta.get("arrived"))
            rows = result.rows
            if not isinstance(rows, list):
                rows = np.asarray(rows, dtype=np.float32)
            front.send(link.result(request_id, rows, timing.queue_s, timing.inference_s))
        except link.TooLarge as exc:
            front.send(link.error(request_id, "too_large", str(exc)))
        except ClientGone:
            pass  # the front has stopped waiting
        except QueueFull as exc:
            front.send(link.error(request_id, "queue_full", str(exc), exc.retry_after, exc.reason))
        except DeadlineUnmet as exc:
            front.send(link.error(request_id, "deadline", str(exc)))
        except RequestOverQuota as exc:
            front.send(link.error(request_id, "over_quota", str(exc)))
        except Exception as exc:
            if is_out_of_memory(exc):
                front.send(link.error(request_id, "oom", str(exc)))
            else:
                log.exception("engine error on a front's request")
                front.send(link.error(request_id, "internal", f"{type(exc).__name__}: {exc}"))
        finally:
            if trace is not None:
                trace.end()
            timing.end()
            front.gone.pop(request_id, None)

    async def _call(self, front: _Front, request_id: int, question: dict) -> None:
        """A small question from a front: the int8 calibration of a model (computed once, here)."""
        svc = self.models.services.get(str(question.get("model")))
        if question.get("op") != "calibration" or svc is None or not svc.loaded:
            front.send(link.answer(request_id, {"error": f"cannot answer {question!r}"}))
            return
        try:
            calibration = await svc.calibrated()
        except Exception as exc:
            front.send(link.answer(request_id, {"error": f"{type(exc).__name__}: {exc}"}))
            return
        rows = np.ascontiguousarray(calibration.rows, dtype=np.float32)
        front.send(link.answer(request_id, {"shape": list(rows.shape), "source": calibration.source},
                               rows.tobytes()))
