"""The hub's informers: the kit's (embedfleet/kit/informer.py), counting their restarts in the operator's
``embedfleet_operator_watch_restarts_total{kind}``."""

from __future__ import annotations

from typing import Any

from embedfleet.kit.informer import Informer as KitInformer
from embedfleet.kit.informer import InformerStats, object_key, version_at_least
from embedfleet.operator.metrics import WATCH_RESTARTS

__all__ = ["Informer", "InformerStats", "object_key", "version_at_least"]


def _count_restart(kind: str) -> None:
    WATCH_RESTARTS.labels(kind=kind).inc()


class Informer(KitInformer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("on_restart", _count_restart)
        super().__init__(*args, **kwargs)
