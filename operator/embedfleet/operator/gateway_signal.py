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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from embedfleet.operator.signals import Target

LOAD_PATH = "/gateway/load"
MAX_BODY_BYTES = 1 << 20  # a gateway's report is a few hundred bytes per deployment
DEADLINE_S = 2.0


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


async def _report(client: httpx.AsyncClient, target: Target) -> Mapping[str, Any] | str:
    try:
        async with asyncio.timeout(DEADLINE_S):
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
        return f"{target.pod}: no answer within {DEADLINE_S:g}s"
    except (httpx.HTTPError, orjson.JSONDecodeError) as exc:
        return f"{target.pod}: {type(exc).__name__}: {exc}"


async def read_gateways(targets: list[Target], key: str) -> GatewayReading:
    """Ask every gateway pod at once; bounded by DEADLINE_S whatever they do."""
    if not targets:
        return GatewayReading()
    async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
        reports = await asyncio.gather(*(_report(client, t) for t in targets))
    return combine(reports, key)


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
