"""render(): one spec -> the whole cluster footprint, checked against the Kubernetes client's models."""

from __future__ import annotations

import copy
from importlib import metadata
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from schema_helpers import k8s_model_problems

from embedfleet.operator import platform
from embedfleet.operator.crd import naming
from embedfleet.operator.crd.models import EmbeddingDeploymentSpec
from embedfleet.operator.render import effective_replicas, render
from embedfleet.operator.render.cache_volumes import (
    CacheClaim,
    claim_manifest,
    claim_owner,
    stale_volume,
    volume_manifest,
    wanted_claims,
)

DIGEST = "sha256:" + "5e" * 32
ROOT = "/var/lib/embedfleet/cache"
NO_CONTROL_PLANE = [
    {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"},
]
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
    "EMBEDFLEET_FRONTS",
    "EMBEDFLEET_ENGINES",
    "EMBEDFLEET_MAX_QUEUE_SECONDS",
    "EMBEDFLEET_MAX_QUEUE_SECONDS_BULK",
    "EMBEDFLEET_DRAIN_TIMEOUT",
    "EMBEDFLEET_MODEL_DIGEST",
    "EMBEDFLEET_ENGINE_CACHE_DIR",
    "EMBEDFLEET_REVISION",
    "EMBEDFLEET_VECTOR_SPACE",
    "EMBEDFLEET_PROBE_INTERVAL",
    "EMBEDFLEET_PROBE_MIN_COSINE",
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
    assert data["EMBEDFLEET_MODEL"] == f"/var/cache/embedfleet/local/sha256-{'5e' * 32}"
    assert data["EMBEDFLEET_MODEL_DIGEST"] == DIGEST  # the runtime re-verifies what it loads
    # One revision (no status yet): r1 in vector space r1, probe checks on the spec's defaults.
    assert data["EMBEDFLEET_REVISION"] == "r1" and data["EMBEDFLEET_VECTOR_SPACE"] == "r1"
    assert data["EMBEDFLEET_PROBE_INTERVAL"] == "300" and data["EMBEDFLEET_PROBE_MIN_COSINE"] == "0.999"
    container = runtime_container(manifests)
    assert container["envFrom"] == [{"configMapRef": {"name": "minilm-config"}}]
    api_key = next(e for e in container["env"] if e["name"] == "EMBEDFLEET_API_KEY")
    assert api_key["valueFrom"]["secretKeyRef"] == {"name": "emb-key", "key": "token"}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    # Ready within a second of answering; NotReady after 5 s of failed reads (at a 5 s period: 5 to 10 s)
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] == 1 and ready["periodSeconds"] * ready["failureThreshold"] == 5
    startup = container["startupProbe"]
    assert startup["periodSeconds"] == 1 and startup["periodSeconds"] * startup["failureThreshold"] == 600
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 45 + 5
    assert pod["securityContext"]["runAsNonRoot"] is True and container["securityContext"]["runAsNonRoot"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    annotations = by_kind(manifests)["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "8080"
    assert "nvidia.com/gpu" not in str(container["resources"])


def test_queue_bounds_reach_the_runtime_as_its_settings_read_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """spec.runtime.maxQueueSeconds(/Bulk): the runtime refuses at the bound the gateway sheds by
    (gateway/bounds.py); unset, the runtime keeps its own default (no variable at all)."""
    runtime_settings = pytest.importorskip("embedfleet.runtime.settings")
    data = by_kind(render("minilm", "ml", "uid-1", spec_of(runtime={"maxQueueSeconds": 2.5,
                                                                   "maxQueueSecondsBulk": 12})))["ConfigMap"]["data"]
    assert set(data) <= CONTRACT_ENV
    for var in ("EMBEDFLEET_MAX_QUEUE_SECONDS", "EMBEDFLEET_MAX_QUEUE_SECONDS_BULK"):
        monkeypatch.setenv(var, data[var])  # as envFrom hands the ConfigMap to the pod
    read = runtime_settings.RuntimeSettings()
    assert (read.max_queue_seconds, read.max_queue_seconds_bulk) == (2.5, 12.0)
    plain = by_kind(render("minilm", "ml", "uid-1", spec_of()))["ConfigMap"]["data"]
    assert "EMBEDFLEET_MAX_QUEUE_SECONDS" not in plain and "EMBEDFLEET_MAX_QUEUE_SECONDS_BULK" not in plain


def test_fronts_reach_the_runtime_as_its_own_setting(monkeypatch) -> None:
    """spec.runtime.fronts is the runtime's --fronts (split serving); unset, the runtime's default (auto)
    stands, and the schema bounds it as the runtime does."""
    data = by_kind(render("minilm", "ml", "uid-1", spec_of(runtime={"fronts": 4})))["ConfigMap"]["data"]
    monkeypatch.setenv("EMBEDFLEET_FRONTS", data["EMBEDFLEET_FRONTS"])  # as envFrom hands it to the pod
    runtime_settings = pytest.importorskip("embedfleet.runtime.settings")
    assert runtime_settings.RuntimeSettings().front_processes() == 4
    plain = by_kind(render("minilm", "ml", "uid-1", spec_of()))["ConfigMap"]["data"]
    assert "EMBEDFLEET_FRONTS" not in plain
    for bad in (-1, 65):
        with pytest.raises(ValueError, match="fronts"):
            spec_of(runtime={"fronts": bad})


def test_engines_reach_the_runtime_as_its_own_setting(monkeypatch) -> None:
    """spec.runtime.engines is the runtime's --engines; unset, the runtime's one engine stands."""
    data = by_kind(render("minilm", "ml", "uid-1", spec_of(runtime={"fronts": 2, "engines": 3})))["ConfigMap"]["data"]
    monkeypatch.setenv("EMBEDFLEET_ENGINES", data["EMBEDFLEET_ENGINES"])  # as envFrom hands it to the pod
    runtime_settings = pytest.importorskip("embedfleet.runtime.settings")
    assert runtime_settings.RuntimeSettings().engines == 3
    plain = by_kind(render("minilm", "ml", "uid-1", spec_of()))["ConfigMap"]["data"]
    assert "EMBEDFLEET_ENGINES" not in plain
    for bad in (0, 9):
        with pytest.raises(ValueError, match="engines"):
            spec_of(runtime={"fronts": 2, "engines": bad})


def test_standby_reaches_the_runtime_as_its_own_setting(monkeypatch) -> None:
    """spec.runtime.standby is the runtime's --standby; unset, the runtime's default (off) stands."""
    runtime_settings = pytest.importorskip("embedfleet.runtime.settings")
    for wanted in (True, False):
        data = by_kind(render("minilm", "ml", "uid-1", spec_of(runtime={"standby": wanted})))["ConfigMap"]["data"]
        monkeypatch.setenv("EMBEDFLEET_STANDBY", data["EMBEDFLEET_STANDBY"])  # as envFrom hands it to the pod
        assert runtime_settings.RuntimeSettings().standby is wanted
    plain = by_kind(render("minilm", "ml", "uid-1", spec_of()))["ConfigMap"]["data"]
    assert "EMBEDFLEET_STANDBY" not in plain


def test_a_tenants_keys_file_is_mounted_from_its_secret() -> None:
    """apiKeysSecret: the Secret's key as a read-only file named by EMBEDFLEET_API_KEYS; no single key."""
    spec = spec_of(runtime={"apiKeysSecret": {"name": "emb-tenants", "key": "tenants.yaml"}})
    manifests = render("minilm", "ml", "uid-1", spec)
    for m in manifests:
        assert k8s_model_problems(m) == [], m["kind"]
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert volume == {"name": "api-keys", "secret": {
        "secretName": "emb-tenants", "items": [{"key": "tenants.yaml", "path": "keys.yaml"}], "defaultMode": 0o440}}
    # 0440 reads for the group: the pod's fsGroup, which the runtime's user belongs to.
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["api-keys"] == {"name": "api-keys", "mountPath": "/etc/embedfleet/api-keys", "readOnly": True}
    assert mounts["tmp"]["mountPath"] == "/tmp"
    env = {e["name"]: e for e in container["env"]}
    assert env["EMBEDFLEET_API_KEYS"] == {"name": "EMBEDFLEET_API_KEYS",
                                         "value": "/etc/embedfleet/api-keys/keys.yaml"}
    assert "EMBEDFLEET_API_KEY" not in env
    data = by_kind(manifests)["ConfigMap"]["data"]
    assert not {"EMBEDFLEET_API_KEY", "EMBEDFLEET_API_KEYS"} & set(data)
    # Without the field: no volume, no mount, no variable.
    plain = by_kind(render("minilm", "ml", "uid-1", spec_of()))["Deployment"]["spec"]["template"]["spec"]
    assert not [v for v in plain["volumes"] if "secret" in v]
    assert "EMBEDFLEET_API_KEYS" not in {e["name"] for e in plain["containers"][0]["env"]}
    # Naming another Secret (or key) changes the pod template, so the pods roll onto it.
    other = render("minilm", "ml", "uid-1", spec_of(runtime={"apiKeysSecret": {"name": "emb-t2", "key": "k"}}))
    assert by_kind(other)["Deployment"]["spec"]["template"] != by_kind(manifests)["Deployment"]["spec"]["template"]


def test_download_without_prepull_uses_an_init_container() -> None:
    manifests = render("minilm", "ml", "uid-1", spec_of())
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    init = pod["initContainers"][0]["command"]
    assert init[:3] == ["embedfleet", "cache", "pull"]
    assert init[init.index("--digest") + 1] == DIGEST
    assert init[init.index("--cache-dir") + 1] == "/var/cache/embedfleet/local"
    assert "--from-node-cache" not in init
    assert {"name": "model-cache", "emptyDir": {}} in pod["volumes"]
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    # The only affinity is the platform's: never on a control-plane node.
    assert pod["affinity"] == {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": NO_CONTROL_PLANE}]}}}
    allowed = render("minilm", "ml", "uid-1", spec_of(), allow_control_plane=True)
    assert "affinity" not in by_kind(allowed)["Deployment"]["spec"]["template"]["spec"]


def _images(manifests: list[dict[str, Any]]) -> set[str]:
    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    return {c["image"] for c in pod["containers"] + pod.get("initContainers", [])}


def test_the_specs_image_wins_over_the_platforms_default() -> None:
    pinned = spec_of(runtime={"image": "registry.example/team/runtime:7"})
    assert _images(render("m", "ml", "u", pinned, default_image="ghcr.io/embedfleet/runtime:9.9.9")) == {
        "registry.example/team/runtime:7"}
    assert _images(render("m", "ml", "u", pinned)) == {"registry.example/team/runtime:7"}


def test_an_unset_image_is_the_platforms_default_else_the_builtin_one() -> None:
    unset = spec_of()
    assert unset.runtime.image is None
    # The runtime and the model fetcher (init container) run the same image.
    assert _images(render("m", "ml", "u", unset, default_image="mirror.example/runtime:2")) == {
        "mirror.example/runtime:2"}
    assert _images(render("m", "ml", "u", unset)) == {platform.BUILTIN_RUNTIME_IMAGE}
    assert platform.BUILTIN_RUNTIME_IMAGE == f"ghcr.io/embedfleet/runtime:{metadata.version('embedfleet')}"


def test_a_new_default_rolls_only_deployments_that_name_no_image() -> None:
    """The Deployment's pod template changes with the default (the Deployment controller rolls it); a
    pinned spec renders the same objects whatever the default."""
    unset, pinned = spec_of(), spec_of(runtime={"image": "ghcr.io/embedfleet/runtime:0.0.9"})
    a = render("m", "ml", "u", unset, default_image="ghcr.io/embedfleet/runtime:1")
    b = render("m", "ml", "u", unset, default_image="ghcr.io/embedfleet/runtime:2")
    assert by_kind(a)["Deployment"]["spec"]["template"] != by_kind(b)["Deployment"]["spec"]["template"]
    assert by_kind(a)["ConfigMap"] == by_kind(b)["ConfigMap"]
    assert render("m", "ml", "u", pinned, default_image="ghcr.io/embedfleet/runtime:1") == render(
        "m", "ml", "u", pinned, default_image="ghcr.io/embedfleet/runtime:2")


@pytest.mark.parametrize("required", [False, True])
def test_prepull_mounts_the_tenants_node_entry_and_prefers_labelled_nodes(required: bool) -> None:
    """Pre-pull renders no DaemonSet, ServiceAccount or binding in the tenant namespace: only the
    runtime pod, which mounts its own tenant's entry read-only through a claim in its namespace (no host
    path in the pod: render/cache_volumes.py makes the claim and its volume)."""
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
    assert [m["kind"] for m in manifests] == ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"]
    for m in manifests:
        assert k8s_model_problems(m) == [], m["kind"]

    pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    node_volume = next(v for v in pod["volumes"] if v["name"] == "node-cache")
    assert node_volume["persistentVolumeClaim"] == {"claimName": f"embedfleet-sha256-{'5e' * 32}", "readOnly": True}
    assert not [v for v in pod["volumes"] if "hostPath" in v]
    assert wanted_claims("ml", manifests) == [CacheClaim("ml", naming.cache_claim(DIGEST))]
    assert naming.cache_entry("ml", DIGEST) == f"ml_sha256-{'5e' * 32}"
    mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
    assert mounts["node-cache"] == {"name": "node-cache", "mountPath": "/var/cache/embedfleet/node",
                                    "readOnly": True}
    assert mounts["model-cache"]["mountPath"] == "/var/cache/embedfleet/local" and mounts["model-cache"]["readOnly"]
    init = pod["initContainers"][0]
    command = init["command"]
    for flag, value in [
        ("--source", BASE["model"]["source"]),
        ("--digest", DIGEST),
        ("--cache-dir", "/var/cache/embedfleet/local"),
        ("--from-node-cache", "/var/cache/embedfleet/node"),
    ]:
        assert command[command.index(flag) + 1] == value
    init_mounts = {m["name"]: m for m in init["volumeMounts"]}
    assert init_mounts["node-cache"]["readOnly"] is True and not init_mounts["model-cache"].get("readOnly")
    assert init["securityContext"]["runAsNonRoot"] is True
    data = by_kind(manifests)["ConfigMap"]["data"]
    assert data["EMBEDFLEET_MODEL"] == f"/var/cache/embedfleet/local/sha256-{'5e' * 32}"

    affinity = pod["affinity"]["nodeAffinity"]
    expression = {"key": naming.cache_label_key(DIGEST, "ml"), "operator": "In", "values": ["ready"]}
    assert expression["key"] == f"cache.embedfleet.dev/t{naming.tenant_tag('ml')}-sha256-" + "5e" * 8
    terms = affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms[0]["matchExpressions"][:len(NO_CONTROL_PLANE)] == NO_CONTROL_PLANE
    if required:
        assert expression in terms[0]["matchExpressions"]
    else:
        assert expression not in terms[0]["matchExpressions"]
        assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"] == {
            "matchExpressions": [expression]
        }


def test_two_tenants_with_one_digest_get_separate_entries_and_labels() -> None:
    spec = spec_of(cache={"prePull": True})

    def entry(namespace: str) -> tuple[str, str]:
        manifests = render("m", namespace, "u", spec)
        pod = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
        (claim,) = wanted_claims(namespace, manifests)
        path = volume_manifest(claim, ROOT, "claim-uid")["spec"]["hostPath"]["path"]
        label = pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
        return path, label["preference"]["matchExpressions"][0]["key"]

    (path_a, label_a), (path_b, label_b) = entry("team-a"), entry("team-b")
    assert path_a != path_b and label_a != label_b
    assert path_a.startswith(ROOT + "/") and "/" not in path_a[len(ROOT) + 1 :]  # flat: no parent to create


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
    assert terms[0]["matchExpressions"][len(NO_CONTROL_PLANE)]["key"] == "nvidia.com/gpu.product"
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
    assert "EMBEDFLEET_MODEL_DIGEST" not in by_kind(local)["ConfigMap"]["data"]


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


def test_unset_batching_is_left_to_the_runtime() -> None:
    """No EMBEDFLEET_MAX_BATCH_* unless the spec sets them: the runtime's own defaults apply, and on a GPU
    its start-up sizing (docs/gpu.md) instead of CPU numbers."""
    config = next(o for o in render("m", "ml", "u", spec_of(runtime={"gpu": {"count": 1}})) if o["kind"] == "ConfigMap")
    assert "EMBEDFLEET_MAX_BATCH_TOKENS" not in config["data"] and "EMBEDFLEET_MAX_BATCH_REQUESTS" not in config["data"]


def test_a_cache_claim_and_its_volume_name_one_tenants_entry_and_only_that_claim() -> None:
    """The objects behind a pre-pulling pod's claims: the volume is a hostPath at the tenant's entry, Retain,
    pre-bound by name and uid to the claim, read-only many for weights and read-write many for engine builds;
    the claim names that volume and is owned (not controlled) by the deployment, so others can share it."""
    weights = CacheClaim("team-a", naming.cache_claim(DIGEST))
    engines = CacheClaim("team-a", naming.engines_claim(DIGEST))
    assert (weights.engines, engines.engines) == (False, True) and weights.digest == engines.digest == DIGEST
    for claim, entry, modes in ((weights, naming.cache_entry("team-a", DIGEST), ["ReadOnlyMany"]),
                                (engines, naming.engines_entry("team-a", DIGEST), ["ReadWriteMany"])):
        volume = volume_manifest(claim, ROOT + "/", "uid-c")
        assert k8s_model_problems(volume) == []
        assert volume["metadata"]["name"] == f"embedfleet.team-a.{claim.claim}" == naming.cache_volume(
            "team-a", claim.claim)
        spec = volume["spec"]
        assert spec["hostPath"] == {"path": f"{ROOT}/{entry}", "type": "DirectoryOrCreate"}
        assert spec["claimRef"] == {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "namespace": "team-a",
                                    "name": claim.claim, "uid": "uid-c"}
        assert spec["persistentVolumeReclaimPolicy"] == "Retain" and spec["storageClassName"] == ""
        assert spec["accessModes"] == modes
        made = claim_manifest(claim, [claim_owner("m", "uid-m")])
        assert k8s_model_problems(made) == []
        assert made["metadata"]["namespace"] == "team-a"
        assert made["spec"]["volumeName"] == volume["metadata"]["name"] and made["spec"]["accessModes"] == modes
        assert made["spec"]["storageClassName"] == ""
        assert made["metadata"]["ownerReferences"][0]["controller"] is False
        labels = volume["metadata"]["labels"]
        assert labels["embedfleet.dev/namespace"] == "team-a" and labels["embedfleet.dev/digest"] == "5e" * 8
        assert volume["metadata"]["annotations"]["embedfleet.dev/digest"] == DIGEST


def test_a_volume_is_stale_once_its_claim_is_gone_released_or_another() -> None:
    claim = CacheClaim("team-a", naming.cache_claim(DIGEST))
    volume = volume_manifest(claim, ROOT, "uid-c")
    live = {"metadata": {"name": claim.claim, "uid": "uid-c"}}
    assert not stale_volume({**volume, "status": {"phase": "Bound"}}, live)
    assert not stale_volume({**volume, "status": {"phase": "Available"}}, live)
    assert stale_volume({**volume, "status": {"phase": "Released"}}, live)
    assert stale_volume(volume, None)
    assert stale_volume(volume, {"metadata": {"name": claim.claim, "uid": "uid-newer"}})
