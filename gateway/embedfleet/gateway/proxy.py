"""The gateway's HTTP face: each work request goes, by its model, to a replica of that deployment,
and the replica's answer goes back byte for byte (never re-serialised): streamed as it comes, or, when
it is short and its length known, in one write.

Per request: read the body (--payload-limit), find `model` (400 malformed JSON, 404 unknown model,
400 no model while several are served), take a replica from the fleet (at once, or after a hold), send
the request with the headers that matter and the time left of its deadline, and stream the answer.
A replica that did not take the request (503 `draining`, connection refused or reset before any
answer) is marked so at once and the request goes to another one, or back to the hold; once a replica
may have run it (an answer began, or a timeout after sending) it is never sent again, with one
exception: a replica whose host went silent (TCP keepalive unanswered: a node lost or cut off, wire.py)
before the answer's first byte will never answer, so the request is sent to another one (work is
idempotent; a job submission gets 502 `upstream_lost` instead, as it may have been stored). Every request
carries the vector space its name resolves to (`x-embedfleet-vector-space`, pinning.py); a replica or a
region's gateway that refuses it for that (409 `vector_space_mismatch`) did not take it either: the
request goes to another of the right space, and the refusal is never passed off as an answer.

The gateway's own routes: /health, /ready, /metrics, /gateway/load (what an autoscaler reads), and
GET /v1/models merged over the deployments.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
from collections.abc import Callable
from functools import partial

import aiohttp
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from embedfleet.calls import JSON, Call, Reply, Stream, json_reply
from embedfleet.compat.names import split_model
from embedfleet.gateway.classes import input_count, is_bulk
from embedfleet.gateway.config import GatewayConfig
from embedfleet.gateway.eject import is_failure
from embedfleet.gateway.errors import COHERE_PREFIX, Refused, error_reply
from embedfleet.gateway.fleet import Deployment, Fleet, Ticket
from embedfleet.gateway.metrics import UNKNOWN, GatewayMetrics
from embedfleet.gateway.pick import State, pick
from embedfleet.gateway.pinning import HEADER_VECTOR_SPACE, is_mismatch
from embedfleet.gateway.spill import SPILLED_FROM, refused_there
from embedfleet.gateway.upstreams import Replica
from embedfleet.gateway.wire import Answer, ConnectFailed, Disconnected, Lost, WireClient, WireError

log = logging.getLogger("embedfleet.gateway.proxy")

PASS_REQUEST_HEADERS = ("authorization", "content-type", "accept", "accept-encoding", "x-priority", "x-request-id",
                        "traceparent", "tracestate", "user-agent")
DROP_RESPONSE_HEADERS_RAW = frozenset({b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer",
                                       b"upgrade", b"proxy-authenticate", b"proxy-connection", b"content-length",
                                       b"date", b"server"})
CONNECT_TIMEOUT_S = 3.0  # a replica that does not accept a connection in this long did not get the request
DEADLINE_GRACE_S = 2.0  # past the deadline sent down, the gateway stops waiting (the runtime answers 504 itself)
EXTRA_ATTEMPTS = 3  # beyond one per replica: replicas can come back between attempts
WHOLE_BELOW = 256 * 1024  # answers up to this size are passed on in one write; longer ones stream as they come
JOB_PREFIX = "/async/"  # a POST there creates a job: not idempotent, never sent twice
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})  # work: a JSON body naming its model


def _draining(raw: bytes) -> bool:
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    return isinstance(doc, dict) and isinstance(doc.get("error"), dict) and doc["error"].get("code") == "draining"


def _creates_job(request: Call) -> bool:
    """Is this a job submission (the one work request that is not idempotent)?"""
    return request.method == "POST" and request.path.startswith(JOB_PREFIX)


def _timeout(value: object) -> float | None:
    """A positive finite number of seconds, or None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    return None


class Gateway:
    def __init__(self, config: GatewayConfig, fleet: Fleet, metrics: GatewayMetrics,
                 session: aiohttp.ClientSession, rng: random.Random | None = None,
                 wire: WireClient | None = None) -> None:
        self.config = config
        self.fleet = fleet
        self.metrics = metrics
        self.session = session  # only for GET /v1/models to every deployment (not work: a poll's kind)
        # the client all work goes through (wire.py), to replicas and other regions' gateways alike
        self.wire = wire or WireClient(config.max_connections_per_replica)
        # a replica that fails its poll may have gone silent with requests on it keepalive cannot judge
        fleet.upstreams.on_failed_poll = self.wire.suspect
        self.rng = rng or random.Random()
        self.draining = False
        self.synced: Callable[[], bool] = lambda: True  # Kubernetes mode: the first lists are in
        self._own = {"/health": self.health, "/ready": self.ready, "/metrics": self.prometheus,
                     "/gateway/load": self.load, "/v1/models": self.models}

    async def handle(self, call: Call) -> Reply | Stream:
        """The server's handler (calls.py): the gateway's own routes by GET or HEAD, all else is work."""
        if call.method in ("GET", "HEAD"):
            own = self._own.get(call.path)
            if own is not None:
                return await own(call)
        return await self.forward(call)

    # -- the gateway's own routes

    async def health(self, call: Call) -> Reply:
        return json_reply({"status": "ok"})

    async def ready(self, call: Call) -> Reply:
        if self.draining:
            return json_reply({"status": "draining"}, 503)
        if not self.synced():  # it would answer 404 for every model it has not yet seen
            return json_reply({"status": "syncing"}, 503)
        return json_reply({"status": "ready"})

    async def prometheus(self, call: Call) -> Reply:
        return Reply(200, generate_latest(self.metrics.registry), [("content-type", CONTENT_TYPE_LATEST)])

    async def load(self, call: Call) -> Reply:
        return json_reply({"deployments": self.fleet.snapshot(), "draining": self.draining})

    async def models(self, call: Call) -> Reply:
        """Every deployment's models, asked of one replica each; a deployment with none ready is listed by
        name. A replica's refusal (a wrong API key) is the answer."""
        headers = self._headers(call, None)

        async def ask(name: str) -> tuple[str, int | None, bytes]:
            replica = pick(self.fleet.upstreams.replicas(name), self.rng)
            if replica is None:
                return name, None, b""
            try:
                async with self.session.get(f"{replica.url}/v1/models", headers=headers,
                                            timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    return name, resp.status, await resp.read()
            except (aiohttp.ClientError, TimeoutError):
                return name, None, b""

        answers = await asyncio.gather(*(ask(name) for name in self.fleet.deployments))
        routed = {key: model for model, key in self.fleet.aliases.items()}  # Kubernetes: deployment -> its name
        data, seen = [], set()
        for name, status, raw in answers:
            if status is not None and status != 200:
                self.metrics.requests.labels(UNKNOWN, str(status)).inc()
                return Reply(status, raw, [("content-type", JSON)])
            try:
                cards = orjson.loads(raw)["data"] if status == 200 else None
            except (orjson.JSONDecodeError, KeyError, TypeError):
                cards = None
            if not isinstance(cards, list):
                cards = [{"id": name, "object": "model", "owned_by": "embedfleet", "ready": False}]
            model = routed.get(name, name)
            if split_model(model)[1] is not None:  # a revision side by side: listed by the name that reaches it
                cards = [{**c, "id": model} if isinstance(c, dict) and c.get("id") == split_model(model)[0] else c
                         for c in cards]
            for card in cards:
                if isinstance(card, dict) and card.get("id") not in seen:
                    seen.add(card.get("id"))
                    data.append(card)
        self.metrics.requests.labels(UNKNOWN, "200").inc()
        return json_reply({"object": "list", "data": data})

    # -- work

    async def forward(self, request: Call) -> Reply | Stream:
        arrived = self.fleet.now()
        try:
            body = self._body(request)
            model, body_timeout, inputs = self._model_of(request, body)
            pin = request.headers.get(HEADER_VECTOR_SPACE, "").strip() or None  # spilled in: keep its space
            deployment = self.fleet.resolve(model, pin)
        except Refused as refused:
            return self._refuse(refused, UNKNOWN, request.path)
        ticket = self.fleet.begin(deployment)
        ticket.model, ticket.space, ticket.pinned = model or deployment.name, pin, pin is not None
        ticket.may_spill = SPILLED_FROM not in request.headers
        ticket.bulk = is_bulk(request.headers.get("x-priority"), inputs, self.config.urgent_max_inputs)
        try:
            deadline = self._deadline(request, arrived, body_timeout)
            return await self._send(request, deployment, ticket, body, deadline)
        except Refused as refused:
            if refused.code == "overloaded":
                reason = "expected_wait_bulk" if ticket.bulk else "expected_wait"
                self.metrics.shed.labels(deployment.name, reason).inc()
            return self._refuse(refused, deployment.name, request.path)
        finally:
            self.fleet.end(deployment)

    def _refuse(self, refused: Refused, deployment: str, path: str) -> Reply:
        self.metrics.requests.labels(deployment, str(refused.status)).inc()
        # (after a 413 the connection closes: the body was left unread)
        return error_reply(refused, cohere=path.startswith(COHERE_PREFIX))

    def _body(self, request: Call) -> bytes:
        """The request's body, read whole by calls.py up to --payload-limit (an oversized one is not)."""
        if request.oversized is not None:
            limit = self.config.payload_limit
            size = f" of {request.oversized} bytes" if request.oversized >= 0 else ""
            raise Refused(413, f"request body{size} is over the payload limit of {limit} bytes (--payload-limit)",
                          "payload_too_large")
        return request.body

    @staticmethod
    def _model_of(request: Call, body: bytes) -> tuple[str | None, float | None, int]:
        """The served model the request names (body `model`, or `?model=` on a GET or DELETE), the
        body's `timeout`, if any, and how many inputs it carries (classes.py)."""
        if request.method not in BODY_METHODS:
            return request.query.get("model"), None, 1
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise Refused(400, f"malformed JSON body: {exc}", "invalid_json") from None
        if not isinstance(doc, dict):
            return None, None, 1
        model = doc.get("model")
        if model is not None and not isinstance(model, str):
            raise Refused(400, f"`model` must be a string naming a served model, not {type(model).__name__}",
                          "invalid_request")
        return model, _timeout(doc.get("timeout")), input_count(doc)

    def _deadline(self, request: Call, arrived: float, body_timeout: float | None) -> float | None:
        """When the request must be answered (time.monotonic()): the soonest of the client's
        X-Request-Timeout, its body's `timeout` and --request-timeout; None without any."""
        timeouts = [t for t in (body_timeout, self.config.request_timeout) if t is not None]
        raw = request.headers.get("x-request-timeout")
        if raw is not None:
            try:
                value = _timeout(float(raw))
            except ValueError:
                value = None
            if value is None:
                raise Refused(422, f"X-Request-Timeout must be a positive number of seconds, not {raw!r}",
                              "invalid_timeout")
            timeouts.append(value)
        return arrived + min(timeouts) if timeouts else None

    def _headers(self, request: Call, deadline: float | None) -> dict[str, str]:
        headers = {name: value for name in PASS_REQUEST_HEADERS if (value := request.headers.get(name)) is not None}
        if deadline is not None:
            left = deadline - self.fleet.now()
            if left <= 0:
                raise Refused(504, "the request's deadline passed before a replica could take it",
                              "deadline_exceeded")
            headers["x-request-timeout"] = f"{left:.3f}"
        return headers

    async def _send(self, request: Call, deployment: Deployment, ticket: Ticket, body: bytes,
                    deadline: float | None) -> Reply | Stream:
        attempts = 0
        while True:
            replica = await self.fleet.acquire(deployment, ticket, deadline)
            try:
                answer = await self._exchange(request, deployment, replica, ticket, body, deadline)
            finally:
                self.fleet.done(replica)
            if answer is not None:
                if ticket.spilled_to is not None:
                    self.metrics.spilled.labels(deployment.name, ticket.spilled_to.region,
                                               ticket.spill_reason).inc()
                return answer
            if ticket.spilled_to is not None:  # that region's gateway did not take it: not again for a while
                if ticket.spilled_to.url not in ticket.refused:  # (one that refused its space: not for this one)
                    ticket.spilled_to.down_at = self.fleet.now()
                ticket.spilled_to = None
            attempts += 1
            if attempts >= len(self.fleet.upstreams.replicas(deployment.name)) + EXTRA_ATTEMPTS:
                raise Refused(502, f"no replica of {deployment.name} took the request after {attempts} attempts",
                              "upstream_unavailable")

    async def _exchange(self, request: Call, deployment: Deployment, replica: Replica, ticket: Ticket,
                        body: bytes, deadline: float | None) -> Reply | Stream | None:
        """One attempt on `replica`: its answer streamed back, or None when it did not take the request
        (marked so; the caller tries again)."""
        headers = self._headers(request, deadline)
        if ticket.spilled_to is not None:
            headers[SPILLED_FROM] = self.config.region or "unknown"
        if ticket.space is not None:
            headers[HEADER_VECTOR_SPACE] = ticket.space
        total_s = None if deadline is None else deadline - self.fleet.now() + DEADLINE_GRACE_S
        upstreams = self.fleet.upstreams
        sent = self.fleet.now()
        try:
            upstream = await self.wire.request(
                replica.url, request.method, request.raw_path, headers, body, total_s=total_s,
                connect_timeout=CONNECT_TIMEOUT_S,
                on_complete=None if ticket.spilled_to is not None else partial(self._deliver, request))
        except ConnectFailed as exc:  # refused, unreachable, or not accepted in time: the replica never saw it
            return self._not_taken(deployment, replica, State.DOWN, "connect", str(exc))
        except Lost as exc:
            # its host went silent (wire.py): no answer will come, so the request goes to another replica as
            # if it had never been sent. It may have run there: work requests are idempotent; a job
            # submission is not sent twice.
            if _creates_job(request):
                self.fleet.upstreams.mark(replica, State.DOWN, str(exc))
                raise Refused(502, f"a replica of {deployment.name} went silent before answering; the job may "
                              "or may not have been stored", "upstream_lost") from None
            return self._not_taken(deployment, replica, State.DOWN, "lost", str(exc))
        except Disconnected as exc:
            # closed or reset before any byte of an answer: most often a kept-alive connection the replica
            # had just closed, so the replica is not marked (a dead one refuses the next connection). A job
            # submission is not sent twice: the job may have been stored before the connection dropped.
            if _creates_job(request):
                raise Refused(502, f"a replica of {deployment.name} closed the connection before answering; the "
                              "job may or may not have been stored", "upstream_disconnected") from None
            return self._not_taken(deployment, replica, None, "disconnected", str(exc))
        except WireError as exc:  # BadAnswer (not HTTP, a head over its bound), or one that broke off in its head
            raise Refused(502, f"bad answer from a replica of {deployment.name}: {exc}", "bad_gateway") from None
        except TimeoutError:
            raise Refused(504, f"no answer from {deployment.name} within the request's deadline",
                          "upstream_timeout") from None
        if upstream.delivered is not None:  # the client has it (_deliver)
            async with upstream:
                pass
            upstreams.answered(replica, upstream.headers)
            self._answered(deployment, replica, ticket, upstream.status, self.fleet.now(), sent)
            return upstream.delivered  # type: ignore[return-value]
        upstream.on_complete = None  # the head came before the rest: the answer goes the usual way
        async with upstream:
            first_byte = self.fleet.now()
            length = upstream.content_length
            if length is not None and length <= WHOLE_BELOW:
                # read whole (never more than WHOLE_BELOW: a longer or endless answer streams with back-
                # pressure): a 503 to see whether it is `draining`, a 409 whether it is a refusal for the
                # request's vector space (both short, with a length); a short answer to pass on in one write
                try:
                    raw = await upstream.read()
                except (WireError, TimeoutError) as exc:
                    raise Refused(502, f"the answer from a replica of {deployment.name} broke off: {exc}",
                                  "upstream_broke_off") from None
                if upstream.status != 200 or ticket.spilled_to is not None:  # perhaps a refusal: see which
                    upstreams.answered(replica, upstream.headers)
                if upstream.status == 503 and _draining(raw):
                    return self._not_taken(deployment, replica, State.DRAINING, "draining", "answered 503 draining")
                if is_mismatch(upstream.status, raw):  # another space's replica, or a region a flip apart
                    target = ticket.spilled_to
                    ticket.refused[replica.url] = "replica" if target is None else target.region
                    log.info("%s: %s refused the request for vector space %s", deployment.name,
                             replica.url if target is None else f"region {target.region}", ticket.space)
                    return self._not_taken(deployment, replica, None, "vector_space", "answered 409 vector space")
                if ticket.spilled_to is not None and refused_there(upstream.status, raw):
                    # that region could not take it either (spill.py): the next target, or back here
                    log.info("%s: region %s answered %d; trying elsewhere", deployment.name,
                             ticket.spilled_to.region, upstream.status)
                    return self._not_taken(deployment, replica, None, "spill_refused",
                                           f"region {ticket.spilled_to.region} answered {upstream.status}")
                # the client has its answer before the bookkeeping, which is then off its path
                reply = request.send(Reply(upstream.status, raw, self._response_headers(upstream), upstream.reason))
                if upstream.status == 200 and ticket.spilled_to is None:
                    upstreams.answered(replica, upstream.headers)
                self._answered(deployment, replica, ticket, upstream.status, first_byte, sent)
                return reply
            upstreams.answered(replica, upstream.headers)
            self._answered(deployment, replica, ticket, upstream.status, first_byte, None)
            response = request.stream(upstream.status, upstream.reason, self._response_headers(upstream), length)
            try:
                async for chunk in upstream.iter_any():
                    await response.write(chunk)
            except (WireError, TimeoutError) as exc:
                if not response.started:  # nothing of it went to the client yet: the gateway's own answer
                    raise Refused(502, f"the answer from a replica of {deployment.name} broke off: {exc}",
                                  "upstream_broke_off") from None
                log.warning("%s: answer from %s broke off: %s", deployment.name, replica.url, exc)
                request.abort()
                return response
            await response.end()
        self.metrics.upstream_seconds.labels(deployment.name).observe(self.fleet.now() - sent)
        return response

    def _deliver(self, request: Call, answer: Answer) -> Reply | None:
        """The lean client calls this the moment a short answer is complete. A 200 goes to the client
        there and then: one turn of the event loop, and the way back up through the request's coroutine,
        less between the replica's last byte and the client's. Anything else (a
        refusal that may send the request elsewhere, a long answer to stream) is left to `_exchange`."""
        if answer.status != 200 or answer.content_length is None or answer.content_length > WHOLE_BELOW:
            return None
        return request.send(Reply(200, answer.body_now(), self._response_headers(answer), answer.reason))

    def _not_taken(self, deployment: Deployment, replica: Replica, state: State | None, reason: str,
                   detail: str) -> None:
        if state is not None:
            self.fleet.upstreams.mark(replica, state, detail)
            if reason == "connect":  # (a loss is one event, however many requests it ends: not counted)
                self._outcome(deployment, replica, True)
        else:
            log.debug("%s: %s did not answer: %s", deployment.name, replica.url, detail)
        self.metrics.retries.labels(deployment.name, reason).inc()
        return None

    def _answered(self, deployment: Deployment, replica: Replica, ticket: Ticket, status: int, first_byte: float,
                  sent: float | None) -> None:
        """Count the answer (and, for the replica, a success or a failure: eject.py); a held request's
        cold start ends at the answer's first byte; `sent`: the answer is complete, so the upstream's
        time is known too."""
        self.metrics.requests.labels(deployment.name, str(status)).inc()
        self._outcome(deployment, replica, is_failure(status))
        if ticket.held_since is not None:
            self.metrics.cold_start.labels(deployment.name).observe(first_byte - ticket.held_since)
        if sent is not None:
            self.metrics.upstream_seconds.labels(deployment.name).observe(self.fleet.now() - sent)

    def _outcome(self, deployment: Deployment, replica: Replica, failed: bool) -> None:
        if self.fleet.outcome(replica, failed):
            self.metrics.ejections.labels(deployment.name).inc()

    @staticmethod
    def _response_headers(upstream: Answer) -> bytes:
        """The answer's headers to pass on, those of the hop to the replica dropped, as the bytes they
        came in (never decoded and encoded again)."""
        return b"".join([b"%s: %s\r\n" % (k, v) for k, v in upstream.raw_headers
                         if k.lower() not in DROP_RESPONSE_HEADERS_RAW])

