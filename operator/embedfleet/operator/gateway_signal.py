"""What the cluster's gateways say about one deployment: requests they hold, and when they last saw one.

The runtime pods' in-flight gauge cannot see two things the autoscaler needs:
* requests held by a gateway while the deployment has no ready replica (a cold start from zero): they
  must count as load at once, or nothing ever scales 0 -> 1;
* traffic between scrapes: a query every few seconds that takes 6 ms reads as 0 in flight at every
  tick, and scale-to-zero would remove the only replica of a deployment in use.
Each gateway pod answers `GET /gateway/load` with, per deployment (`<namespace>/<name>`), its held and
in-flight requests and the age of the last request it routed there. Held requests add to the load;
the newest request time over all gateways is the deployment's last activity. A gateway that does not
answer makes the reading `unknown`: scale-to-zero then waits (a missing answer is not idleness).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from embedfleet.operator.crd import naming
from embedfleet.operator.signals import Target

LOAD_PATH = "/gateway/load"
MAX_BODY_BYTES = 1 << 20  # a gateway's report is a few hundred bytes per deployment
DEADLINE_S = 2.0
#: The chart's gateway pods carry this label (the autoscaler's watch and the spoke's heartbeat find them by it).
POD_LABELS = {naming.COMPONENT_LABEL: "gateway"}
#: The gateways' HTTP port (the chart sets it from gateway.port).
ENV_GATEWAY_PORT = "EMBEDFLEET_GATEWAY_PORT"


def gateway_port() -> int:
    return int(os.environ.get(ENV_GATEWAY_PORT, "8000"))


@dataclass(frozen=True)
class GatewayReading:
    """Summed over the gateways that answered."""

    held: float = 0.0
    last_request_age_s: float | None = None  # the newest request any gateway routed here; None: none seen
    gateways: int = 0
    errors: tuple[str, ...] = ()

    @property
    def unknown(self) -> bool:
        return bool(self.errors)


def combine(reports: Iterable[Mapping[str, Any] | str], key: str) -> GatewayReading:
    """Fold the gateways' reports (parsed JSON, or an error string) for deployment `key`. Pure."""
    held, ages, errors, answered = 0.0, [], [], 0
    for report in reports:
        if isinstance(report, str):
            errors.append(report)
            continue
        answered += 1
        entry = (report.get("deployments") or {}).get(key) or {}
        held += float(entry.get("held") or 0.0)
        age = entry.get("last_request_age_s")
        if age is not None:
            ages.append(max(0.0, float(age)))
    return GatewayReading(held, min(ages) if ages else None, answered, tuple(errors))


async def _report(client: httpx.AsyncClient, target: Target, deadline_s: float = DEADLINE_S
                  ) -> Mapping[str, Any] | str:
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("GET", target.url) as response:
                response.raise_for_status()
                body = b""
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_BODY_BYTES:
                        return f"{target.pod}: report over {MAX_BODY_BYTES} bytes"
        report = orjson.loads(body)
        if not isinstance(report, dict):
            return f"{target.pod}: report is not a JSON object"
        return report
    except TimeoutError:
        return f"{target.pod}: no answer within {deadline_s:g}s"
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        return f"{target.pod}: {type(exc).__name__}: {exc}"


async def ask_gateways(targets: list[Target], deadline_s: float = DEADLINE_S) -> list[Mapping[str, Any] | str]:
    """Every gateway pod's report (or why it gave none), asked all at once: bounded by `deadline_s`
    whatever they do."""
    if not targets:
        return []
    async with httpx.AsyncClient(timeout=deadline_s) as client:
        return list(await asyncio.gather(*(_report(client, t, deadline_s) for t in targets)))


async def read_gateways(targets: list[Target], key: str) -> GatewayReading:
    """Ask every gateway pod at once; bounded by DEADLINE_S whatever they do."""
    if not targets:
        return GatewayReading()
    return combine(await ask_gateways(targets), key)


def gateway_targets(pods: Iterable[Mapping[str, Any]], port: int) -> list[Target]:
    """`/gateway/load` of every Running gateway pod with an IP (readiness aside: a gateway that is not
    ready yet may already hold requests)."""
    out = []
    for pod in pods:
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if status.get("phase") == "Running" and ip and not (pod.get("metadata") or {}).get("deletionTimestamp"):
            out.append(Target(pod["metadata"]["name"], f"http://{ip}:{port}{LOAD_PATH}"))
    return out
