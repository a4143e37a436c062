"""Importing this package registers every kopf handler of the operator for its role (EMBEDFLEET_ROLE).

standalone/spoke: thin reconcile handlers (validate.py -> render.py -> kube.py -> status) and the autoscaler
daemon; a spoke also renews its heartbeat lease. hub: only the fleet scheduling loop (embedfleet.operator.hub),
never local pods.
"""

import importlib.util
import os

from embedfleet.operator.handlers import settings

ROLE = os.environ.get("EMBEDFLEET_ROLE", "standalone")
__all__ = ["settings"]

if ROLE == "hub":
    from embedfleet.operator.hub import handlers as hub_handlers

    __all__ += ["hub_handlers"]
else:
    from embedfleet.operator.handlers import embedding, model_cache

    __all__ += ["embedding", "model_cache"]
    if importlib.util.find_spec("embedfleet.operator.handlers.autoscale_daemon") is not None:
        from embedfleet.operator.handlers import autoscale_daemon

        __all__ += ["autoscale_daemon"]
    if ROLE == "spoke":
        from embedfleet.operator.spoke import handlers as spoke_handlers

        __all__ += ["spoke_handlers"]
