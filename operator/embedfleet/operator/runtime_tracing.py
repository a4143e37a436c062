"""The platform's tracing settings for runtime pods: the chart's `tracing` values reach the operator as
``EMBEDFLEET_RUNTIME_<NAME>`` variables, and every runtime ConfigMap it renders carries them as
``<NAME>``, so a platform team turns traces on for every deployment in a region at once (as the gateway's
pods get them straight from the chart). Tracing is a platform setting, not a tenant's: there is no CRD
field, so a tenant cannot point its pods' exporter at an address of its choosing.

Only the names below pass; anything else with the prefix is ignored, so this cannot become a way to set
arbitrary runtime configuration past the CRD's validation. Pure: reads only the mapping it is given.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PREFIX = "EMBEDFLEET_RUNTIME_"
PASSED = (
    "EMBEDFLEET_OTEL",
    "OTEL_SERVICE_NAME",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
    "OTEL_RESOURCE_ATTRIBUTES",
)


def runtime_tracing_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to add to every runtime ConfigMap; empty when the platform did not turn tracing on."""
    source = os.environ if environ is None else environ
    env = {name: source[PREFIX + name] for name in PASSED if source.get(PREFIX + name)}
    if env.get("EMBEDFLEET_OTEL", "").lower() not in ("1", "true", "yes", "on"):
        return {}
    return env
