"""The chart's `tracing` values reach runtime pods through the operator (operator/runtime_tracing.py):
chart -> the operator's EMBEDFLEET_RUNTIME_* variables -> every runtime ConfigMap -> the runtime's own
on/off rule. Off by default, only the listed names pass, and turning it on rolls the pods."""

from __future__ import annotations

from tests.chart.helm import operator_container, template

from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.render import content_hash, render_config_map
from embedfleet.operator.runtime_tracing import runtime_tracing_env
from embedfleet.otel import exporters
from embedfleet.runtime.settings import RuntimeSettings

SPEC = EmbeddingDeploymentSpec.model_validate(
    {"model": {"source": "https://weights.example/minilm.tar", "digest": "sha256:" + "5e" * 32}})
ON = {"tracing.enabled": "true", "tracing.endpoint": "http://otel.observability:4318",
      "tracing.sampler": "parentbased_traceidratio", "tracing.samplerArg": "0.1",
      "tracing.resourceAttributes": "deployment.environment=prod"}


def operator_env(sets: dict[str, str]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in operator_container(template([], sets))["env"] if "value" in e}


def runtime_config(sets: dict[str, str]) -> dict[str, str]:
    return render_config_map("bge", "team-a", "uid-1", SPEC, runtime_tracing_env(operator_env(sets)))["data"]


def test_off_by_default_nothing_reaches_the_runtime() -> None:
    assert not [n for n in operator_env({}) if n.startswith("EMBEDFLEET_RUNTIME_")]
    data = runtime_config({})
    assert not [n for n in data if n.startswith("OTEL_") or n == "EMBEDFLEET_OTEL"]
    assert exporters(False, data) == ()


def test_chart_values_turn_tracing_on_in_every_runtime_pod(monkeypatch) -> None:
    data = runtime_config(ON)
    assert data["EMBEDFLEET_OTEL"] == "true"
    assert data["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel.observability:4318"
    assert data["OTEL_TRACES_SAMPLER"] == "parentbased_traceidratio" and data["OTEL_TRACES_SAMPLER_ARG"] == "0.1"
    assert data["OTEL_SERVICE_NAME"] == "embedfleet-runtime"
    assert data["OTEL_RESOURCE_ATTRIBUTES"] == "deployment.environment=prod,embedfleet.deployment=bge"
    # the runtime reads the ConfigMap as its environment: its settings and its own rule say trace, over OTLP
    # (only the tracing switch: the model path in the ConfigMap exists in the pod, not here)
    monkeypatch.setenv("EMBEDFLEET_OTEL", data["EMBEDFLEET_OTEL"])
    assert exporters(RuntimeSettings().otel, data) == ("otlp",)
    # the pod template carries the ConfigMap's hash, so switching tracing rolls the runtime pods
    assert content_hash(data) != content_hash(runtime_config({}))


def test_only_listed_names_pass_and_only_when_switched_on() -> None:
    env = {"EMBEDFLEET_RUNTIME_OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
           "EMBEDFLEET_RUNTIME_EMBEDFLEET_MODEL": "/etc/passwd", "EMBEDFLEET_RUNTIME_LD_PRELOAD": "/x.so"}
    assert runtime_tracing_env(env) == {}  # endpoint alone does not switch it on
    on = runtime_tracing_env({**env, "EMBEDFLEET_RUNTIME_EMBEDFLEET_OTEL": "true"})
    assert on == {"EMBEDFLEET_OTEL": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}
    data = render_config_map("bge", "team-a", "uid-1", SPEC, on)["data"]
    assert data["EMBEDFLEET_MODEL"] != "/etc/passwd" and "LD_PRELOAD" not in data
