"""Importing this package registers every kopf handler of the operator.

Handlers are thin: parse/validate (validate.py), render (render.py), apply (kube.py), report status.
The autoscaler daemon lives in its own module and is registered here when present, so the reconcile
handlers never depend on it.
"""

import importlib.util

from embedfleet.operator.handlers import embedding, model_cache, settings

__all__ = ["embedding", "model_cache", "settings"]

if importlib.util.find_spec("embedfleet.operator.handlers.autoscale_daemon") is not None:
    from embedfleet.operator.handlers import autoscale_daemon

    __all__ += ["autoscale_daemon"]
