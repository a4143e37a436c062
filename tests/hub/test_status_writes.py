"""The hub's status writes wait for its own last write to come back through its watch
(operator/embedfleet/operator/hub/reporting.py `Reporter.settled`).

A round reads the hub object from its informer; when the watch event of the hub's previous status write has
not arrived yet, the status it computes from that view repeats the previous write, with new transition
times (and its Events again). Such an object waits for the next round instead.
"""

from __future__ import annotations

from typing import Any

from embedfleet.kit.informer import version_at_least
from embedfleet.operator.hub.reporting import Reporter


class FakeInformer:
    """What Reporter reads of an informer: the version its view has reached, and whether it holds an object."""

    def __init__(self, version: str) -> None:
        self.version = version

    def caught_up(self, version: str) -> bool:
        return not version or version_at_least(self.version, version)

    def holds(self, obj: Any) -> bool:
        return True


class FakeHub:
    """Records status patches; each returns the object as written, with the next resourceVersion."""

    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []
        self.version = 100

    def patch_status(self, kind: str, name: str, namespace: str | None, status: Any) -> dict[str, Any]:
        self.patches.append(dict(status))
        self.version += 1
        return {"metadata": {"name": name, "namespace": namespace, "resourceVersion": str(self.version)}}


def ed(status: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "spread", "namespace": "team", "uid": "u1", "resourceVersion": "100"},
            "status": status or {}}


def test_a_status_is_not_written_again_from_a_view_that_does_not_show_the_last_write() -> None:
    hub, informer = FakeHub(), FakeInformer("100")
    reporter = Reporter(hub, {"deployments": informer})  # type: ignore[arg-type]
    stale = ed({"replicas": {"ready": 2}})
    reporter.write_status(stale, {"replicas": {"ready": 3}})
    assert len(hub.patches) == 1
    # the next round still reads the old view (even if the watch has moved on since it was read): no write
    informer.version = "105"
    assert not reporter.settled("deployments", stale)
    reporter.write_status(stale, {"replicas": {"ready": 3}})
    assert len(hub.patches) == 1
    # a view that shows the write (its resourceVersion is the write's or later): the next change is written
    fresh = ed({"replicas": {"ready": 3}})
    fresh["metadata"]["resourceVersion"] = "101"
    reporter.write_status(fresh, {"replicas": {"ready": 4}})
    assert hub.patches == [{"replicas": {"ready": 3}}, {"replicas": {"ready": 4}}]


def test_a_write_once_seen_is_forgotten_and_odd_versions_are_not_compared() -> None:
    hub, informer = FakeHub(), FakeInformer("100")
    reporter = Reporter(hub, {"deployments": informer})  # type: ignore[arg-type]
    obj = ed()
    reporter.write_status(obj, {"replicas": {"ready": 1}})
    obj["metadata"]["resourceVersion"] = "101"
    assert reporter.settled("deployments", obj) and not reporter._written
    odd = ed()
    odd["metadata"]["resourceVersion"] = "opaque-1"
    reporter.write_status(odd, {"replicas": {"ready": 2}})
    assert reporter.settled("deployments", odd)  # not an integer: never held back (no object starves)
