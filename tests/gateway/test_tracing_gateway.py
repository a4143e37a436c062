"""The gateway's tracing switches (docs/tracing.md): the chart's `tracing` values become the gateway pods'
OTEL_* variables and turn tracing on there, and a bad exporter name stops `embedfleet gateway` at once.
Span structure across gateway and runtime is tested in tests/runtime/test_tracing.py."""

from __future__ import annotations

import subprocess
import sys

from embedfleet.otel import exporters
from tests.chart.helm import gateway_deployment, template
from tests.procs import ROOT, child_env


def gateway_env(sets: dict[str, str]) -> dict[str, str]:
    (container,) = gateway_deployment(template([], sets))["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


def test_chart_tracing_values_reach_the_gateway_pods() -> None:
    off = gateway_env({})
    assert not [name for name in off if name.startswith("OTEL_") or name == "EMBEDFLEET_OTEL"]
    assert exporters(off.get("EMBEDFLEET_OTEL") == "true", off) == ()

    on = gateway_env({"tracing.enabled": "true", "tracing.endpoint": "http://otel.observability:4318",
                      "tracing.sampler": "parentbased_traceidratio", "tracing.samplerArg": "0.25",
                      "tracing.resourceAttributes": "deployment.environment=prod"})
    assert on["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel.observability:4318"
    assert on["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and on["OTEL_TRACES_SAMPLER_ARG"] == "0.25"
    assert on["OTEL_RESOURCE_ATTRIBUTES"] == "deployment.environment=prod"
    assert on["OTEL_SERVICE_NAME"] == "embedfleet-gateway"
    # what the gateway's --otel default reads, and the rule it applies
    assert exporters(on["EMBEDFLEET_OTEL"] == "true", on) == ("otlp",)


def test_unknown_exporter_stops_the_gateway_naming_it() -> None:
    done = subprocess.run([sys.executable, "-m", "embedfleet.runtime.cli", "gateway", "--upstream",
                           "m=http://127.0.0.1:9"], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=child_env({"OTEL_TRACES_EXPORTER": "zipkin", "OTEL_SDK_DISABLED": None}))
    assert done.returncode == 2
    assert "OTEL_TRACES_EXPORTER" in done.stderr and "zipkin" in done.stderr
