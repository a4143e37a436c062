"""render(): one spec -> the whole cluster footprint, checked against the Kubernetes client's models."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schema_helpers import k8s_model_problems

from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec, ModelCacheSpec
from embedfleet.operator.render import effective_replicas, render, render_model_cache

DIGEST = "sha256:" + "5e" * 32
BASE: dict[str, Any] = {"model": {"source": "https://weights.example/minilm.tar", "digest": DIGEST}}
CONTRACT_ENV = {
    "EMBEDFLEET_MODEL",
    "EMBEDFLEET_SERVED_MODEL_NAME",
    "EMBEDFLEET_HOST",
    "EMBEDFLEET_PORT",
    "EMBEDFLEET_DEVICE",
    "EMBEDFLEET_DTYPE",
    "EMBEDFLEET_ENGINE",
    "EMBEDFLEET_MAX_BATCH_TOKENS",
    "EMBEDFLEET_MAX_BATCH_REQUESTS",
    "EMBEDFLEET_MAX_CLIENT_BATCH_SIZE",
    "EMBEDFLEET_MAX_CONCURRENT_REQUESTS",
    "EMBEDFLEET_MAX_INPUT_TOKENS",
    "EMBEDFLEET_PAYLOAD_LIMIT",
    "EMBEDFLEET_API_KEY",
    "EMBEDFLEET_TOKENIZER_WORKERS",
    "EMBEDFLEET_DRAIN_TIMEOUT",
}


def spec_of(**sections: Any) -> EmbeddingDeploymentSpec:
    raw = copy.deepcopy(BASE)
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return EmbeddingDeploymentSpec.model_validate(raw)


def by_kind(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {m["kind"]: m for m in manifests}


def runtime_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    return by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]["containers"][0]


def test_basic_footprint_and_models() -> None:
    manifests = render("minilm", "ml", "uid-1", spec_of())
    assert [m["kind"] for m in manifests] == ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"]
    for m in manifests:
        assert k8s_model_problems(m) == [], m["kind"]
        assert m["metadata"]["namespace"] == "ml"
        assert m["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "embedfleet.dev/v1alpha1",
                "kind": "EmbeddingDeployment",
                "name": "minilm",
                "uid": "uid-1",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]


def test_runtime_contract_env_probes_and_drain() -> None:
    spec = spec_of(
        runtime={
            "maxBatchRequests": 64,
            "maxBatchTokens": 8192,
            "drainTimeoutSeconds": 45,
            "apiKeySecret": {"name": "emb-key", "key": "token"},
        }
    )
    manifests = render("minilm", "ml", "uid-1", spec)
    data = by_kind(manifests)["ConfigMap"]["data"]
    assert set(data) <= CONTRACT_ENV
    assert data["EMBEDFLEET_MAX_BATCH_REQUESTS"] == "64" and data["EMBEDFLEET_MAX_BATCH_TOKENS"] == "8192"
    assert data["EMBEDFLEET_DEVICE"] == "cpu" and data["EMBEDFLEET_DRAIN_TIMEOUT"] == "45"
    assert data["EMBEDFLEET_MODEL"] == f"/var/cache/embedfleet/sha256-{'5e' * 32}"
    container = runtime_container(manifests)
    assert container["envFrom"] == [{"configMapRef": {"name": "minilm-config"}}]
    api_key = next(e for e in container["env"] if e["name"] == "EMBEDFLEET_API_KEY")
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "emb-key", "key": "token"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 45 + 5
    assert pod["securityContext"]["runAsNonRoot"] is True and container["securityContext"]["runAsNonRoot"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    annotations = by_kind(manifests)["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8080"
    assert "nvidia.com/gpu" not in str(container["resources"])


def test_download_without_prepull_uses_an_init_container() -> None:
    manifests = render("minilm", "ml", "uid-1", spec_of())
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]["command"]
    assert init[:3] == ["embedfleet", "cache", "pull"]
    assert init[init.index("--digest") + 1] == DIGEST and "--label-node" not in init
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert "affinity" not in pod


@pytest.mark.parametrize("required", [False, True])
def test_prepull_daemonset_affinity_and_readonly_cache(required: bool) -> None:
    spec = spec_of(
        cache={
            "prePull": True,
            "requireCachedNode": required,
            "nodePools": [
                {"name": "cpu", "nodeSelector": {"pool": "cpu"}},
                {"name": "gpu", "nodeSelector": {"pool": "gpu"}},
            ],
        }
    )
    manifests = render("minilm", "ml", "uid-1", spec)
    for m in manifests:
        assert k8s_model_problems(m) == [], m["kind"]
    daemonsets = [m for m in manifests if m["kind"] == "DaemonSet"]
    assert [d["metadata"]["name"] for d in daemonsets] == ["minilm-prepull-cpu", "minilm-prepull-gpu"]
    pod = daemonsets[1]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "gpu"}
    pull = pod["initContainers"][0]["command"]
    assert pull[:3] == ["embedfleet", "cache", "pull"]
    for flag, value in [
        ("--source", BASE["model"]["source"]),
        ("--digest", DIGEST),
        ("--cache-dir", "/var/cache/embedfleet"),
        ("--node-name", "$(NODE_NAME)"),
    ]:
        assert pull[pull.index(flag) + 1] == value
    assert "--label-node" in pull
    node_name = pod["initContainers"][0]["env"][0]
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert pod["containers"][0]["command"][-1] == "--hold"
    binding = by_kind(manifests)["ClusterRoleBinding"]
    assert binding["subjects"][0] == {"kind": "ServiceAccount", "name": "minilm-prepull", "namespace": "ml"}
    assert "ownerReferences" not in binding["metadata"]

    runtime_pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    mount = next(m for m in runtime_pod["containers"][0]["volumeMounts"] if m["name"] == "model-cache")
    assert mount["readOnly"] is True
    assert "initContainers" not in runtime_pod
    affinity = runtime_pod["affinity"]["nodeAffinity"]
    expression = {"key": naming.cache_label_key(DIGEST), "operator": "In", "values": ["ready"]}
    assert expression["key"] == "cache.embedfleet.dev/sha256-" + "5e" * 8
    if required:
        terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        assert expression in terms[0]["matchExpressions"]
    else:
        assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"] == {
            "matchExpressions": [expression]
        }


def test_gpu_request_toleration_and_type_affinity() -> None:
    spec = spec_of(runtime={"gpu": {"count": 2, "type": "nvidia-h100"}, "dtype": "bfloat16"})
    manifests = render("big", "ml", "uid-1", spec)
    container = runtime_container(manifests)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert by_kind(manifests)["ConfigMap"]["data"]["EMBEDFLEET_DEVICE"] == "cuda"
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms[0]["matchExpressions"][0]["key"] == "nvidia.com/gpu.product"
    assert k8s_model_problems(by_kind(manifests)["Deployment"]) == []


def test_pvc_and_file_sources_are_mounted_not_pulled() -> None:
    pvc = render("p", "ml", "u", spec_of(model={"source": "pvc://models/minilm", "digest": None}))
    pod = by_kind(pvc)["Deployment"]["spec"]["template"]["spec"]
    assert {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}} in pod[
        "volumes"
    ]
    assert by_kind(pvc)["ConfigMap"]["data"]["EMBEDFLEET_MODEL"] == "/models/pvc/minilm"
    local = render("f", "ml", "u", spec_of(model={"source": "file:///opt/models/minilm", "digest": None}))
    assert by_kind(local)["ConfigMap"]["data"]["EMBEDFLEET_MODEL"] == "/opt/models/minilm"
    assert "initContainers" not in by_kind(local)["Deployment"]["spec"]["template"]["spec"]


def test_service_monitor_only_when_asked_and_available() -> None:
    spec = spec_of(monitoring={"serviceMonitor": True})
    assert "ServiceMonitor" not in by_kind(render("m", "ml", "u", spec))
    assert "ServiceMonitor" not in by_kind(render("m", "ml", "u", spec_of(), service_monitor_available=True))
    monitor = by_kind(render("m", "ml", "u", spec, service_monitor_available=True))["ServiceMonitor"]
    assert monitor["spec"]["endpoints"][0]["port"] == "http"


def test_config_changes_roll_the_pods_and_rendering_is_deterministic() -> None:
    first = render("m", "ml", "u", spec_of())
    assert first == render("m", "ml", "u", spec_of())
    changed = render("m", "ml", "u", spec_of(runtime={"maxBatchTokens": 4096}))

    def config_hash(manifests: list[dict[str, Any]]) -> str:
        return by_kind(manifests)["Deployment"]["spec"]["template"]["metadata"]["annotations"][
            "embedfleet.dev/config-hash"
        ]

    assert config_hash(first) != config_hash(changed)


def test_model_cache_renders_pullers_owned_by_the_cache() -> None:
    spec = ModelCacheSpec.model_validate({"model": BASE["model"], "nodeSelector": {"pool": "gpu"}})
    manifests = render_model_cache("minilm", "ml", "uid-9", spec)
    assert [m["kind"] for m in manifests] == ["ServiceAccount", "ClusterRoleBinding", "DaemonSet"]
    ds = by_kind(manifests)["DaemonSet"]
    assert ds["metadata"]["name"] == "minilm-cache-default"
    assert ds["metadata"]["ownerReferences"][0]["kind"] == "ModelCache"
    for m in manifests:
        assert k8s_model_problems(m) == []


@settings(max_examples=40, deadline=None)
@given(
    lo=st.integers(0, 20),
    span=st.integers(0, 20),
    decided=st.one_of(st.none(), st.integers(0, 100)),
    enabled=st.booleans(),
    to_zero=st.booleans(),
    fixed=st.one_of(st.none(), st.integers(0, 50)),
    drain=st.integers(1, 3600),
    batch=st.integers(1, 4096),
)
def test_any_valid_spec_renders_valid_objects(
    lo: int,
    span: int,
    decided: int | None,
    enabled: bool,
    to_zero: bool,
    fixed: int | None,
    drain: int,
    batch: int,
) -> None:
    spec = spec_of(
        replicas=fixed,
        autoscaling={
            "enabled": enabled,
            "minReplicas": lo,
            "maxReplicas": max(lo + span, 1),
            "scaleToZero": to_zero,
        },
        runtime={"drainTimeoutSeconds": drain, "maxBatchRequests": batch},
    )
    replicas = effective_replicas(spec, decided)
    if enabled:
        assert (0 if to_zero else lo) <= replicas <= max(lo + span, 1)
    else:
        assert replicas == (fixed if fixed is not None else lo)
    manifests = render("m", "ml", "u", spec, autoscaler_desired=decided)
    deployment = by_kind(manifests)["Deployment"]
    assert deployment["spec"]["replicas"] == replicas
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > drain
    for m in manifests:
        assert k8s_model_problems(m) == []


def test_prepull_binding_names_never_collide_across_namespaces() -> None:
    from embedfleet.operator.render import puller_binding_name

    assert puller_binding_name("team-a", "x") != puller_binding_name("team", "a-x")
    assert puller_binding_name("team-a", "x") == puller_binding_name("team-a", "x")
    assert len(puller_binding_name("n" * 63, "p" * 253)) <= 253
