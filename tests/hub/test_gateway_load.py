"""Each region's gateway load, from its gateway pods to its FleetCluster status (issue 15).

The spoke folds its gateways' ``GET /gateway/load`` reports into five numbers (`gateway_load.summarize`),
publishes them on its heartbeat Lease, and the hub copies them to ``status.gateway``, writing only when a
number changes. The last test asks a real gateway process that holds requests for a deployment with no
replica, beside an address where nothing listens and one that never answers.
"""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as hs

from embedfleet.operator.crd.fleet import FleetClusterStatus
from embedfleet.operator.gateway_signal import ask_gateways
from embedfleet.operator.hub import convert
from embedfleet.operator.signals import Target
from embedfleet.operator.spoke import gateway_load
from embedfleet.operator.spoke.heartbeat import GATEWAY_LOAD_ANNOTATION, lease_body
from tests.gateway.conftest import start_gateway, until
from tests.procs import free_port


def _entry(held: int = 0, in_flight: int = 0, ready: int = 0) -> dict:
    """One deployment as a gateway's /gateway/load reports it (gateway/fleet.py `snapshot`)."""
    return {"held": held, "in_flight": in_flight, "ready_replicas": ready, "replicas": 1,
            "last_request_age_s": None, "expected_cold_start_s": 30.0}


def _report(**deployments: dict) -> dict:
    return {"deployments": {k.replace("__", "/"): v for k, v in deployments.items()}, "draining": False}


# ------------------------------------------------------------------ the spoke's fold


def test_no_gateway_pod_is_zeros_not_unknown() -> None:
    assert gateway_load.summarize([]) == {"gateways": 0, "unanswered": 0, "held": 0, "inFlight": 0,
                                          "coldDeployments": 0}


def test_sums_over_gateways_and_counts_a_cold_deployment_once() -> None:
    reports = [
        _report(ml__cold=_entry(held=2, in_flight=2), ml__warm=_entry(in_flight=3, ready=2)),
        _report(ml__cold=_entry(held=1, in_flight=1), ml__warm=_entry(in_flight=1, ready=2)),
        "gateway-2: no answer within 1s",
    ]
    assert gateway_load.summarize(reports) == {"gateways": 2, "unanswered": 1, "held": 3, "inFlight": 7,
                                               "coldDeployments": 1}


@pytest.mark.parametrize(("entries", "cold"), [
    ([_entry(held=1, ready=0), _entry(held=0, ready=1)], 0),  # another gateway sees a ready replica
    ([_entry(held=0, ready=0), _entry(held=0, ready=0)], 0),  # at zero but nobody waits: not a cold start
    ([_entry(held=0, ready=0), _entry(held=4, ready=0)], 1),
])
def test_cold_means_held_and_no_gateway_sees_a_ready_replica(entries: list[dict], cold: int) -> None:
    summary = gateway_load.summarize([_report(ml__x=e) for e in entries])
    assert summary["coldDeployments"] == cold
    assert summary["held"] == sum(e["held"] for e in entries)


def test_what_a_gateway_of_another_version_might_send_counts_as_nothing() -> None:
    odd = [{"deployments": None}, {"deployments": {"a/b": "busy"}},
           _report(a__c={"held": -3, "in_flight": float("nan"), "ready_replicas": True}),
           _report(a__d={"held": 2.6, "in_flight": "7"})]
    assert gateway_load.summarize(odd) == {"gateways": 4, "unanswered": 0, "held": 3, "inFlight": 0,
                                           "coldDeployments": 1}


_counts = hs.integers(0, 10_000)
_reports = hs.lists(hs.one_of(
    hs.just("down"),
    hs.builds(lambda ds: {"deployments": ds},
              hs.dictionaries(hs.sampled_from(["a/x", "a/y", "b/x"]),
                              hs.builds(_entry, held=_counts, in_flight=_counts, ready=hs.integers(0, 3)),
                              max_size=3))), max_size=6)


@given(_reports)
def test_every_gateway_is_counted_once_and_cold_ones_are_held_ones(reports: list) -> None:
    summary = gateway_load.summarize(reports)
    assert summary["gateways"] + summary["unanswered"] == len(reports)
    held_keys = {k for r in reports if isinstance(r, dict) for k, e in r["deployments"].items() if e["held"]}
    assert summary["coldDeployments"] <= len(held_keys)
    assert summary["held"] == sum(e["held"] for r in reports if isinstance(r, dict)
                                  for e in r["deployments"].values())


# ------------------------------------------------------------------ the Lease annotation


def test_the_annotation_is_small_and_reads_back_the_same() -> None:
    summary = {"gateways": 12, "unanswered": 1, "held": 100_000, "inFlight": 2_000_000, "coldDeployments": 40}
    text = gateway_load.annotation(summary)
    assert " " not in text and len(text) < 120, text
    assert gateway_load.parse_annotation(text) == summary
    body = lease_body("ns", "me", 30, [], None, gateway=text)
    assert body["metadata"]["annotations"][GATEWAY_LOAD_ANNOTATION] == text
    # not reported (pods not listable): None, which the merge patch turns into a removal
    assert lease_body("ns", "me", 30, [], None)["metadata"]["annotations"][GATEWAY_LOAD_ANNOTATION] is None


@pytest.mark.parametrize("raw", [None, "", "not json", "[1, 2]", '{"other": 1}', "null"])
def test_the_hub_reads_a_missing_or_unreadable_annotation_as_unknown(raw: str | None) -> None:
    assert gateway_load.parse_annotation(raw) is None


# ------------------------------------------------------------------ the hub's FleetCluster status


def _live(wanted: dict) -> dict:
    """status.gateway as the API server stores what the hub wrote: merge patch, nulls dropped."""
    return {k: v for k, v in wanted.items() if v is not None}


def _merged(live: dict, patch: dict) -> dict:
    """A JSON merge patch (RFC 7386) of a flat object, as the API server applies it: null removes."""
    out = dict(live)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def test_status_gateway_carries_the_url_and_the_numbers_and_passes_the_crd_model() -> None:
    summary = {"gateways": 2, "unanswered": 0, "held": 5, "inFlight": 9, "coldDeployments": 1}
    status = gateway_load.cluster_status("https://gw.eu.example", summary)
    assert status == {"url": "https://gw.eu.example", **summary}
    parsed = FleetClusterStatus.model_validate({"gateway": status}).gateway
    assert parsed is not None and parsed.cold_deployments == 1 and parsed.in_flight == 9


def test_an_idle_fleet_rewrites_no_status() -> None:
    idle = gateway_load.cluster_status("https://gw.eu.example", gateway_load.summarize([_report(ml__x=_entry())]))
    live = {"gateway": _live(idle)}
    for _ in range(3):  # round after round, the same zeros: nothing to write
        assert convert.status_changes(live, {"gateway": gateway_load.cluster_status(
            "https://gw.eu.example", gateway_load.summarize([_report(ml__x=_entry())]))}) == {}
    # nothing known at all equals the `{}` the API server defaults the field to
    assert convert.status_changes({"gateway": {}}, {"gateway": gateway_load.cluster_status(None, None)}) == {}


def test_a_changed_number_is_written_and_a_lost_report_removes_the_numbers() -> None:
    before = gateway_load.cluster_status("https://gw", {"gateways": 1, "unanswered": 0, "held": 0, "inFlight": 0,
                                                        "coldDeployments": 0})
    live = {"gateway": _live(before)}
    busier = gateway_load.cluster_status("https://gw", {**gateway_load.from_mapping(before), "held": 3})
    assert convert.status_changes(live, {"gateway": busier}) == {"gateway": busier}
    # the spoke stopped reporting (it cannot list its gateway pods): the numbers go, the address stays
    lost = gateway_load.cluster_status("https://gw", None)
    patch = convert.status_changes(live, {"gateway": lost})
    assert patch == {"gateway": lost}
    assert _merged(live["gateway"], patch["gateway"]) == {"url": "https://gw"}


def test_while_the_lease_cannot_be_read_the_last_numbers_are_kept() -> None:
    live = {"url": "https://gw", "gateways": 3, "unanswered": 1, "held": 2, "inFlight": 4, "coldDeployments": 1}
    kept = gateway_load.cluster_status("https://gw", gateway_load.from_mapping(live))
    assert convert.status_changes({"gateway": live}, {"gateway": kept}) == {}
    assert gateway_load.from_mapping({"url": "https://gw"}) is None  # an address alone is no report


# ------------------------------------------------------------------ a real gateway


def test_a_real_gateway_holding_requests_and_two_that_do_not_answer() -> None:
    """Two requests held for a deployment with no replica: 2 held, 2 in flight, 1 cold; an address where
    nothing listens and a socket that accepts but never answers are `unanswered`, within the deadline."""
    gateway = start_gateway("--upstream", f"cold=http://127.0.0.1:{free_port()}", "--hold-timeout", "120")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the connection; nobody reads the request
    targets = [Target("gw-0", f"{gateway.url}/gateway/load"),
               Target("gw-down", f"http://127.0.0.1:{free_port()}/gateway/load"),
               Target("gw-silent", f"http://127.0.0.1:{silent.getsockname()[1]}/gateway/load")]

    async def scenario() -> tuple[dict, dict]:
        quiet = gateway_load.summarize(await ask_gateways(targets, gateway_load.DEADLINE_S))
        async with httpx.AsyncClient(base_url=gateway.url, timeout=120) as client:
            tasks = [asyncio.create_task(client.post("/v1/embeddings", json={"model": "cold", "input": f"t{i}"}))
                     for i in range(2)]
            await until(lambda: gateway.load()["cold"]["held"] == 2, "2 requests held")
            busy = gateway_load.summarize(await ask_gateways(targets, gateway_load.DEADLINE_S))
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return quiet, busy

    try:
        quiet, busy = asyncio.run(scenario())
    finally:
        silent.close()
        gateway.stop()
    assert quiet == {"gateways": 1, "unanswered": 2, "held": 0, "inFlight": 0, "coldDeployments": 0}
    assert busy == {"gateways": 1, "unanswered": 2, "held": 2, "inFlight": 2, "coldDeployments": 1}
    assert json.loads(gateway_load.annotation(busy)) == busy
