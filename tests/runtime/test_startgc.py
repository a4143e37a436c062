"""The collector runs rarely while a server starts and as usual again, with the start's objects frozen, once
it is ready or its start has failed (runtime/startgc.py): through the application's own lifespan, with the
real default model; and what the freeze keeps, measured in a fresh interpreter."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest

from embedfleet.runtime import startgc
from embedfleet.runtime.api.app import create_app
from embedfleet.runtime.api.gate import GateState
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.service import Models
from embedfleet.runtime.settings import RuntimeSettings

DEFAULT = gc.get_threshold()


@pytest.fixture(autouse=True)
def collector_as_it_was() -> Iterator[None]:
    """Each test leaves the process' collector on, at its thresholds, and nothing frozen, whatever it did."""
    yield
    startgc.release()
    gc.enable()
    gc.set_threshold(*DEFAULT)
    gc.unfreeze()


def test_hold_collects_rarely_and_release_freezes_and_puts_the_thresholds_back() -> None:
    gc.unfreeze()
    startgc.hold()
    assert gc.get_threshold()[0] == startgc.START_THRESHOLD and startgc.held()
    startgc.hold()  # a second hold keeps the thresholds to put back
    startgc.release()
    assert gc.get_threshold() == DEFAULT and gc.isenabled() and not startgc.held()
    assert gc.get_freeze_count() > 0, "what the start made is moved out of the collector's passes"
    frozen = gc.get_freeze_count()
    startgc.release()  # a second release changes nothing
    assert gc.get_threshold() == DEFAULT and gc.get_freeze_count() == frozen


def test_a_collector_turned_off_by_the_caller_is_left_to_it() -> None:
    gc.unfreeze()
    gc.disable()
    startgc.hold()
    startgc.release()
    assert not gc.isenabled() and gc.get_threshold() == DEFAULT
    assert gc.get_freeze_count() == 0


class FailingModels(Models):
    async def load(self) -> None:
        raise RuntimeError("no weights here")


async def start(models: Models) -> tuple[int, tuple[int, int, int], int]:
    """Run the app's lifespan until its load is over: (first threshold while loading, thresholds after,
    frozen after)."""
    failed = asyncio.Event()
    app = create_app(models, GateState(), on_load_failed=failed.set)
    async with app.router.lifespan_context(app):
        during = gc.get_threshold()[0]
        for _ in range(1200):
            if models.loaded or failed.is_set():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)  # the load task's `finally` runs on the turn after it finished
        return during, gc.get_threshold(), gc.get_freeze_count()


def test_the_lifespan_releases_the_collector_once_the_model_is_ready() -> None:
    gc.unfreeze()
    startgc.hold()
    models = Models(RuntimeSettings(), RuntimeMetrics())
    during, after, frozen = asyncio.run(start(models))
    assert models.loaded
    assert during == startgc.START_THRESHOLD, "the model loads with the collector running rarely"
    assert after == DEFAULT and frozen > 0, "ready: collection as usual, the start's objects frozen"


def test_the_lifespan_releases_the_collector_when_the_start_fails() -> None:
    gc.unfreeze()
    startgc.hold()
    during, after, frozen = asyncio.run(start(FailingModels(RuntimeSettings(), RuntimeMetrics())))
    assert during == startgc.START_THRESHOLD
    assert after == DEFAULT and frozen > 0, "a failed start puts the thresholds back too"


START_LEFTOVER = """
import tracemalloc
tracemalloc.start()
import asyncio, gc, json, sys
from embedfleet.runtime import startgc
startgc.hold()
from embedfleet.runtime.api.app import create_app
from embedfleet.runtime.api.gate import GateState
from embedfleet.runtime.metrics import RuntimeMetrics
from embedfleet.runtime.service import Models
from embedfleet.runtime.settings import RuntimeSettings

async def main():
    models = Models(RuntimeSettings(model_impl=sys.argv[1]), RuntimeMetrics())
    app = create_app(models, GateState())
    async with app.router.lifespan_context(app):
        while not models.loaded:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0)
        frozen = gc.get_freeze_count()
        gc.unfreeze()
        gc.set_debug(gc.DEBUG_SAVEALL)
        before = tracemalloc.get_traced_memory()[0]
        gc.collect()
        arrays = [type(o).__name__ for o in gc.garbage if hasattr(o, "nbytes") or hasattr(o, "element_size")]
        gc.garbage.clear()
        gc.set_debug(0)
        gc.collect()
        print(json.dumps({"frozen": frozen, "freed": before - tracemalloc.get_traced_memory()[0], "arrays": arrays}))
asyncio.run(main())
"""


@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_what_a_start_leaves_frozen_is_at_most_two_megabytes(impl: str) -> None:
    """The price of freezing instead of collecting (docs/performance.md, Start-up): the cycles a start of the
    default model leaves since the start's last collection, the runtime's own modules and transformers', measured
    by what collecting them would free, in a fresh interpreter."""
    out = subprocess.run([sys.executable, "-c", START_LEFTOVER, impl], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found["frozen"] > 100_000, "the start's objects were frozen"
    assert found["arrays"] == [], "no array or tensor is left in a cycle"
    assert found["freed"] <= 2 * 1024 * 1024, f"{found['freed']} bytes of cycles left frozen by the start"
