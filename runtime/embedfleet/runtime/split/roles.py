"""How `embedfleet serve` builds its process when it is the engine or a front of a split server
(supervisor.py starts them with the same command line, and says which in the environment)."""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

from embedfleet.runtime.settings import RuntimeSettings
from embedfleet.runtime.split.supervisor import INDEX, LISTEN_FD, RUN_DIR, http_path, link_path


@dataclass
class Role:
    """Where a split server's process listens: the engine on its private Unix socket (and the link), a
    front on the socket the supervisor holds."""
    uds: str | None = None
    sockets: list[socket.socket] | None = None
    link: object | None = None  # engine_side.LinkServer (started once HTTP listens)
    index: int = 0


def front_settings(settings: RuntimeSettings, fronts: int) -> RuntimeSettings:
    """A front's share of the pod's bounds: the connection and concurrency limits are the pod's, split
    over its fronts, and its tokenizer threads are its share of the cores."""
    share = max(1, fronts)
    return settings.model_copy(update={
        "max_concurrent_requests": max(1, math.ceil(settings.max_concurrent_requests / share)),
        "max_connections": max(1, math.ceil(settings.max_connections / share)),
        "tokenizer_workers": settings.tokenizer_workers or max(1, settings.cores() // share)})


def engine_settings(settings: RuntimeSettings) -> RuntimeSettings:
    """An engine's share of the pod when there are several (--engines): on a CPU, its torch threads are its
    share of the cores (were each to take them all, the engines' thread pools would fight over them)."""
    if settings.engines == 1 or settings.num_threads or settings.device != "cpu":
        return settings
    return settings.model_copy(update={"num_threads": max(1, settings.cores() // settings.engines)})


def build(role: str, settings: RuntimeSettings, gate, metrics, Server):
    """(models, server) of this process, as serve.run needs them."""
    from embedfleet.runtime.api.app import create_app

    run_dir = os.environ[RUN_DIR]
    index = int(os.environ.get(INDEX, "0"))
    if role == "engine":
        from embedfleet.runtime.service import Models
        from embedfleet.runtime.split.engine_side import LinkServer

        settings = engine_settings(settings)
        models = Models(settings, metrics)
        link = LinkServer(models, link_path(run_dir, index), gate.tracing)
        server = Server(None, settings, gate, metrics, Role(uds=http_path(run_dir, index), link=link, index=index))
        server.app = create_app(models, gate, on_load_failed=server.load_failed, count_requests=False,
                                jobs=index == 0)
        return models, server
    if role != "front":
        raise SystemExit(f"embedfleet serve: unknown split role {role!r}")
    from embedfleet.runtime.split.front_side import FrontModels

    listening = socket.socket(fileno=int(os.environ[LISTEN_FD]))
    models = FrontModels(settings, metrics, [link_path(run_dir, k) for k in range(settings.engines)])
    server = Server(None, settings, gate, metrics, Role(sockets=[listening], index=index))
    server.app = create_app(models, gate, on_load_failed=server.load_failed, engine_uds=http_path(run_dir))
    return models, server
