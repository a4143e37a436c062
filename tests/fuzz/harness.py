"""Schema-driven fuzzing of a live server: every operation of its OpenAPI document, a fixed seed.

`fuzz(url, ...)` loads the document the server serves, generates requests for each operation with
schemathesis (valid ones, then invalid ones), sends them over the socket and checks each answer:

- never a 5xx, but for the 504 a too-short `timeout` asks for;
- the body conforms to the schema the document declares for that status, where it declares one;
- every 4xx (and that 504) carries an error body: the one the document declares for it (Cohere's {"id", "message",
  "code"} on /v2/*), else the common {"error": {"message", "type", "code"}} (api/errors.py).

A failure names the request (method, path, headers, body and a curl line) so that it can be copied
into tests/fuzz/test_regressions.py. Generation is seeded and the example database is off, so the
same seed sends the same requests; EMBEDFLEET_FUZZ_SEED and EMBEDFLEET_FUZZ_EXAMPLES override the
seed and the examples per operation and mode while hunting.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import httpx
import hypothesis
import orjson
import schemathesis
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from schemathesis.specs.openapi.checks import response_schema_conformance

SEED = int(os.environ.get("EMBEDFLEET_FUZZ_SEED", "20240611"))
EXAMPLES = int(os.environ.get("EMBEDFLEET_FUZZ_EXAMPLES", "12"))
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
ERROR_KEYS = {"message", "type", "code"}
AIMS = ("served", "served", "absent", "as_generated")

def operations_of(spec: dict) -> list[str]:
    return sorted(f"{method.upper()} {path}" for path, ops in spec["paths"].items() for method in ops)


def describe(request: httpx.Request | None, response: httpx.Response | None = None) -> str:
    """The request as it went out, ready to copy into a regression test."""
    if request is None:
        return "(no request)"
    shown = {k: v for k, v in request.headers.items() if k.lower() not in {"user-agent", "accept-encoding",
                                                                           "connection", "host", "accept",
                                                                           "x-schemathesis-testcaseid"}}
    body = request.content
    lines = [f"{request.method} {request.url.raw_path.decode()}", f"headers: {shown}",
             f"body ({len(body)} bytes): {body[:2000]!r}"]
    if response is not None:
        lines.append(f"-> {response.status_code} {response.headers.get('content-type')}: {response.text[:800]}")
    return "\n".join(lines)


def promised(response: httpx.Response) -> bool:
    """The one 5xx a request can ask for: a `timeout` (or X-Request-Timeout) too short to meet is 504
    deadline_exceeded, as the request schemas document."""
    if response.status_code != 504:
        return False
    try:
        doc = orjson.loads(response.content)
        error = doc["error"] if "error" in doc else doc  # Cohere's routes: {"id", "message", "code"}
        return error["code"] == "deadline_exceeded"
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return False


def error_body_problem(case: schemathesis.Case, response: httpx.Response) -> str | None:
    """What is wrong with an error's body, or None."""
    declared = case.operation.definition.raw.get("responses", {}).get(str(response.status_code))
    if declared and declared.get("content"):
        return None  # response_schema_conformance holds it to the declared schema
    try:
        body = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return f"a {response.status_code} whose body is not JSON"
    if case.operation.path.startswith("/v2/") and isinstance(body, dict) and set(body) == {"id", "message", "code"}:
        return None if body["message"] else f"a {response.status_code} with an empty error message"  # Cohere's
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS or not all(isinstance(error[k], str)
                                                                          for k in ERROR_KEYS):
        return f'a {response.status_code} without the error body {{"error": {{"message", "type", "code"}}}}'
    if not error["message"]:
        return f"a {response.status_code} with an empty error message"
    return None


@dataclass
class Failure:
    operation: str
    mode: str
    problem: str
    request: str

    def __str__(self) -> str:
        return f"--- {self.operation} ({self.mode}): {self.problem}\n{self.request}"


@dataclass
class Report:
    operations: list[str]
    failures: list[Failure] = field(default_factory=list)
    sent: int = 0
    statuses: dict[str, dict[int, int]] = field(default_factory=dict)  # by operation

    def summary(self) -> str:
        lines = [f"{len(self.operations)} operations, {self.sent} requests, {len(self.failures)} failing"]
        lines += [f"  {op}: {dict(sorted(counts.items()))}" for op, counts in sorted(self.statuses.items())]
        return "\n".join(lines + [str(f) for f in self.failures])


class CheckFailed(AssertionError):
    def __init__(self, problem: str, request: str) -> None:
        super().__init__(f"{problem}\n{request}")
        self.problem, self.request = problem, request


def fuzz(url: str, *, seed: int = SEED, examples: int = EXAMPLES, timeout: float = 60,
         skip: frozenset[str] = frozenset()) -> Report:
    """Fuzz every operation of `url`'s document but those named in `skip` ("POST /v2/embed"); the
    failures are in the report, not raised."""
    with httpx.Client(base_url=url, timeout=timeout) as client:
        spec = client.get("/openapi.json").raise_for_status().json()
        schema = schemathesis.openapi.from_dict(spec, config=schemathesis.Config())
        report = Report(operations_of(spec))
        served = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        for result in schema.get_all_operations():
            operation = result.ok()
            if f"{operation.method.upper()} {operation.path}" in skip:
                continue
            for mode in MODES:
                failure = _fuzz_operation(client, operation, mode, seed, examples, report, served)
                if failure is not None:
                    report.failures.append(failure)
    return report


def aimed(case: schemathesis.Case, aim: str, served: str) -> schemathesis.Case:
    """A generated `model` names no served model, so nearly every request would end in a 404 before it
    reaches the engine: `aim` makes it the served model ("served") or drops it ("absent")."""
    if aim == "as_generated":
        return case
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = served
    if isinstance(case.body, dict) and "model" in case.body:
        if aim == "served":
            case.body["model"] = served
        else:
            del case.body["model"]
    return case


def _fuzz_operation(client: httpx.Client, operation, mode, seed: int, examples: int, report: Report,
                    served: str) -> Failure | None:
    label = f"{operation.method.upper()} {operation.path}"

    def check(case: schemathesis.Case) -> None:
        kwargs = case.as_transport_kwargs(base_url=str(client.base_url).rstrip("/"))
        request = client.build_request(kwargs["method"], kwargs["url"], params=kwargs.get("params"),
                                       headers=kwargs.get("headers"), cookies=kwargs.get("cookies"),
                                       content=_content_of(kwargs))
        try:
            response = client.send(request)
        except httpx.TransportError as exc:
            raise CheckFailed(f"no answer: {type(exc).__name__}: {exc}", describe(request)) from None
        report.sent += 1
        counts = report.statuses.setdefault(label, {})
        counts[response.status_code] = counts.get(response.status_code, 0) + 1
        if response.status_code >= 500 and not promised(response):
            raise CheckFailed(f"server error {response.status_code}", describe(request, response))
        try:
            case.validate_response(response, checks=[response_schema_conformance])
        except BaseExceptionGroup as group:  # schemathesis' FailureGroup: one Failure per broken rule
            found = "; ".join(f"{getattr(f, 'title', type(f).__name__)}: {_first_line(getattr(f, 'message', f))}"
                              for f in group.exceptions)
            raise CheckFailed(f"does not conform to the document: {found}", describe(request, response)) from None
        if 400 <= response.status_code:
            problem = error_body_problem(case, response)
            if problem is not None:
                raise CheckFailed(problem, describe(request, response))

    @hypothesis.settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                         suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink],
                         print_blob=False, report_multiple_bugs=False, verbosity=hypothesis.Verbosity.quiet)
    @hypothesis.seed(seed)
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode), aim=st.sampled_from(AIMS))
    def run(case: schemathesis.Case, aim: str) -> None:
        check(aimed(case, aim, served))

    try:
        run()
    except CheckFailed as exc:
        return Failure(label, mode.value, exc.problem, exc.request)
    except hypothesis.errors.Unsatisfiable:
        return None  # no invalid request exists for an operation without inputs
    return None


def _first_line(message: object) -> str:
    text = str(message).strip()
    return text.splitlines()[0] if text else ""


def _content_of(kwargs: dict) -> bytes | None:
    """The body schemathesis serialised, as bytes (it hands back json=, data= or content=)."""
    if "json" in kwargs:  # as requests would send it (orjson refuses integers past 64 bits)
        return json.dumps(kwargs["json"]).encode()
    data = kwargs.get("content", kwargs.get("data"))
    if data is None or isinstance(data, bytes):
        return data
    if isinstance(data, str):
        return data.encode()
    return json.dumps(data).encode()
