"""The kit informer's loop against a scripted API (embedfleet/kit/informer.py): relists forced one after
another back off (bounded, with jitter), a relist tells only the keys that changed, and a list comes in
pages, falling back to one full list when a continue token expired. The same behaviours against a real
kube-apiserver are in test_informer_real.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from embedfleet.kit.client import KubeError
from embedfleet.kit.informer import Informer, changed_keys, relist_delay


def cm(name: str, rv: str, uid: str = "") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "w", "uid": uid or f"uid-{name}", "resourceVersion": rv}}


class ScriptedAPI:
    """A KubeClient stand-in: ``objects`` is the collection; every watch answers 410 Gone at once (a server
    whose watch cache never reaches the listed version) unless ``watch_ok``."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects
        self.version = 100
        self.lists: list[tuple[int | None, str | None]] = []
        self.list_times: list[float] = []
        self.expire_continue = False
        self.watch_ok = threading.Event()
        self.watches_opened = 0  # watches that delivered (each ends after one bookmark; the informer rewatches)

    def list_page(self, path: str, *, label_selector: str | None = None, field_selector: str | None = None,
                  limit: int | None = None, continue_token: str | None = None) -> tuple[list, str, str]:
        self.lists.append((limit, continue_token))
        self.list_times.append(time.monotonic())
        if continue_token and self.expire_continue:
            raise KubeError(410, "Gone", "The provided continue parameter is too old", f"GET {path}")
        start = int(continue_token or 0)
        end = len(self.objects) if not limit else start + limit
        token = str(end) if end < len(self.objects) else ""
        return [dict(o) for o in self.objects[start:end]], str(self.version), token

    def watch(self, path: str, resource_version: str, *, on_open: Any = None, **_: Any) -> Iterator[dict]:
        if not self.watch_ok.is_set():
            yield {"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "too old"}}
            return
        if on_open is not None:
            on_open(None)
        self.watches_opened += 1
        yield {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": resource_version}}}
        time.sleep(0.05)


@given(n=st.integers(0, 200), low=st.floats(0.01, 5), high=st.floats(5, 60), rand=st.floats(0, 1))
def test_relist_delay_is_bounded_and_grows(n: int, low: float, high: float, rand: float) -> None:
    delay = relist_delay(n, (low, high), rand)
    if n <= 1:
        assert delay == 0.0, "the first relist after a working watch goes at once"
        return
    step = min(high, low * 2 ** (n - 2))
    assert step / 2 <= delay <= step <= high
    assert relist_delay(n + 1, (low, high), 0.0) >= relist_delay(n, (low, high), 0.0)


def test_jitter_spreads_informers_hit_by_the_same_410() -> None:
    delays = {round(relist_delay(5, (0.8, 30.0), r / 10), 6) for r in range(10)}
    assert len(delays) == 10 and min(delays) >= 3.2 and max(delays) <= 6.4


def test_a_server_that_keeps_answering_410_is_not_listed_in_a_tight_loop() -> None:
    """Each relist in a row waits at least the shortest delay ``relist_delay`` allows for its place in the
    row (half its step: 0, 0.1, 0.2, 0.4, 0.5 s here), measured between the lists themselves, so a loaded
    machine (which only lengthens the gaps) cannot fail it; without a back-off the gaps are microseconds."""
    api = ScriptedAPI([cm("a", "1")])
    backoff = (0.2, 1.0)
    inf = Informer(api, "/api/v1/namespaces/w/configmaps", name="gone", relist_backoff=backoff).start()
    try:
        deadline = time.monotonic() + 30
        while len(api.list_times) < 6 and time.monotonic() < deadline:
            time.sleep(0.05)
        times = list(api.list_times)
    finally:
        inf.stop()
    assert len(times) >= 6, f"the informer stopped relisting: {len(times)} lists in 30 s"
    for k, (before, after) in enumerate(pairwise(times), start=1):
        shortest = relist_delay(k, backoff, 1.0)
        assert after - before >= shortest - 0.001, (k, after - before, shortest)
    assert inf.stats.relists >= len(times) - 1


def test_a_watch_that_delivers_resets_the_back_off() -> None:
    """Once watches deliver, the informer rewatches from its version instead of listing: counted in watches
    opened (each ends after one bookmark here), not in seconds, so a slow machine cannot blur the two."""
    api = ScriptedAPI([cm("a", "1")])
    inf = Informer(api, "/api/v1/namespaces/w/configmaps", name="reset", relist_backoff=(0.4, 0.4)).start()
    try:
        assert inf.wait_synced(5)
        api.watch_ok.set()  # the watch works from now on: events/bookmarks arrive, no more relists

        def opened(n: int) -> bool:
            deadline = time.monotonic() + 30
            while api.watches_opened < n and time.monotonic() < deadline:
                time.sleep(0.01)
            return api.watches_opened >= n

        assert opened(1), "no watch opened once the server allowed it"
        before = len(api.lists)
        assert opened(api.watches_opened + 5), "the informer stopped watching"
        assert len(api.lists) == before, "a working watch must not list"
    finally:
        inf.stop()


def test_a_relist_tells_only_the_keys_that_changed() -> None:
    objects = [cm(f"c{i}", "5") for i in range(50)]
    api = ScriptedAPI(objects)
    heard: list[str] = []
    inf = Informer(api, "/api/v1/namespaces/w/configmaps", name="notify", on_change=heard.append,
                   relist_backoff=(0.3, 0.3))
    inf._list()
    assert len(heard) == 50  # the first list: every key is new
    heard.clear()
    objects[7] = cm("c7", "9")  # changed
    del objects[3]  # deleted
    objects.append(cm("new", "10"))  # added
    objects[10] = cm("c11", "5", uid="recreated")  # deleted and created again under the same name
    inf._list()
    assert sorted(heard) == sorted(["w/c7", "w/c3", "w/new", "w/c11"]), heard


def test_changed_keys() -> None:
    old = {"a": cm("a", "1"), "b": cm("b", "1")}
    assert changed_keys(old, {"a": cm("a", "1"), "b": cm("b", "1")}) == set()
    assert changed_keys(old, {"a": cm("a", "2")}) == {"a", "b"}


def test_a_list_comes_in_pages() -> None:
    api = ScriptedAPI([cm(f"c{i}", "1") for i in range(120)])
    inf = Informer(api, "/api/v1/namespaces/w/configmaps", name="pages", page_size=50)
    inf._list()
    assert api.lists == [(50, None), (50, "50"), (50, "100")]
    assert len(inf.items()) == 120 and inf.stats.pages == 3


def test_an_expired_continue_token_falls_back_to_one_full_list() -> None:
    api = ScriptedAPI([cm(f"c{i}", "1") for i in range(120)])
    api.expire_continue = True
    inf = Informer(api, "/api/v1/namespaces/w/configmaps", name="expired", page_size=50)
    inf._list()
    assert api.lists == [(50, None), (50, "50"), (None, None)]
    assert len(inf.items()) == 120 and inf.stats.expired_continues == 1
