"""The CRDs: generated from the pydantic models, checked in, structural, and agreeing with the models."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from schema_helpers import apply_defaults, cr_errors

from embedfleet.operator import autoscale
from embedfleet.operator.crd import AutoscalingSpec, EmbeddingDeploymentSpec
from embedfleet.operator.crd.generate import main as generate_main
from embedfleet.operator.crd.generate import render_files, stale_files
from embedfleet.operator.crd.schema import all_crds, openapi_schema

ROOT = Path(__file__).resolve().parents[2]
DIGEST = "sha256:" + "ab" * 32
MINIMAL = {
    "apiVersion": "embedfleet.dev/v1alpha1",
    "kind": "EmbeddingDeployment",
    "metadata": {"name": "m", "namespace": "default"},
    "spec": {"model": {"source": "hf://BAAI/bge-small-en-v1.5", "digest": DIGEST}},
}


def test_checked_in_crds_match_the_models() -> None:
    assert stale_files(ROOT / "crds") == [], "run: python -m embedfleet.operator.crd.generate"
    assert sorted(p.name for p in (ROOT / "crds").glob("*.yaml")) == sorted(render_files())


def test_generate_command_writes_and_checks(tmp_path: Path) -> None:
    assert generate_main(["--out", str(tmp_path), "--check"]) == 1  # empty dir is stale
    assert generate_main(["--out", str(tmp_path)]) == 0
    assert generate_main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "modelcaches.embedfleet.dev.yaml").write_text("tampered: true\n")
    assert generate_main(["--out", str(tmp_path), "--check"]) == 1


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, value in node.get("properties", {}).items():
            out += _walk(value, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_schema_is_structural(name: str) -> None:
    doc = all_crds()[name]
    assert doc["apiVersion"] == "apiextensions.k8s.io/v1"
    version = doc["spec"]["versions"][0]
    assert version["name"] == "v1alpha1" and version["storage"] and version["subresources"]["status"] == {}
    for path, node in _walk(version["schema"]["openAPIV3Schema"]):
        assert "$ref" not in node and "title" not in node, path
        assert node.get("additionalProperties") is not False, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string") is True, path
        else:
            assert "type" in node, f"{path} has no type"
        if node.get("type") == "object":
            assert {"properties", "additionalProperties", "x-kubernetes-preserve-unknown-fields"} & set(
                node
            ) or path == ".metadata", path


def test_printer_columns_and_scale_subresource() -> None:
    version = all_crds()["embeddingdeployments.embedfleet.dev.yaml"]["spec"]["versions"][0]
    columns = [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert columns == ["Model", "Ready", "Desired", "In-Flight", "Age"]
    scale = version["subresources"]["scale"]
    status_props = version["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    assert scale["specReplicasPath"] == ".spec.replicas"
    assert "current" in status_props["replicas"]["properties"] and "selector" in status_props
    assert status_props["kopf"]["x-kubernetes-preserve-unknown-fields"] is True


EMBEDDING_EXAMPLES = sorted((ROOT / "examples").glob("embedding*.yaml"))


@pytest.mark.parametrize("path", EMBEDDING_EXAMPLES, ids=[p.name for p in EMBEDDING_EXAMPLES])
def test_example_validates_and_parses(path: Path) -> None:
    """Each EmbeddingDeployment example passes the CRD schema and the operator's own checks (nothing
    refused, nothing the operator would mark Accepted=False)."""
    from embedfleet.operator.validate import check

    (example,) = [d for d in yaml.safe_load_all(path.read_text()) if d["kind"] == "EmbeddingDeployment"]
    assert cr_errors("EmbeddingDeployment", example) == []
    EmbeddingDeploymentSpec.model_validate(example["spec"])
    assert check(example["metadata"]["name"], example["spec"])[1] == []


def test_the_first_example_fits_a_small_node_offline() -> None:
    """examples/embedding.yaml, the one the README applies: the model in the runtime image (no download),
    requests a 2-core node holds beside the chart."""
    from kubernetes.utils import parse_quantity

    example = yaml.safe_load((ROOT / "examples" / "embedding.yaml").read_text())
    assert example["spec"]["model"]["source"].startswith("file:///")
    requests = example["spec"]["runtime"]["resources"]["requests"]
    assert parse_quantity(requests["cpu"]) <= parse_quantity("500m")
    assert parse_quantity(requests["memory"]) <= parse_quantity("1Gi")


def test_tenants_example_is_a_labelled_secret_and_a_valid_deployment() -> None:
    """examples/tenants.yaml: its Secret carries the platform's default label and holds a keys file the
    runtime accepts for the served model; its EmbeddingDeployment validates and names that Secret key."""
    from embedfleet.operator import platform
    from embedfleet.operator.validate import check

    secret, deployment = yaml.safe_load_all((ROOT / "examples" / "tenants.yaml").read_text())
    assert (secret["kind"], secret["type"]) == ("Secret", "Opaque")
    assert cr_errors("EmbeddingDeployment", deployment) == []
    parsed, problems = check(deployment["metadata"]["name"], deployment["spec"], platform.PlatformPolicy())
    assert problems == [] and parsed is not None
    ref = parsed.runtime.api_keys_secret
    assert ref is not None and parsed.runtime.api_key_secret is None
    assert ref.name == secret["metadata"]["name"] and ref.key in secret["stringData"]
    assert secret["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    labels = secret["metadata"]["labels"]
    assert platform.secret_problems(ref.name, "default", labels, platform.PlatformPolicy()) == []
    tenants = pytest.importorskip("embedfleet.runtime.tenants")
    keys_file = tenants.KeysFile.model_validate(yaml.safe_load(secret["stringData"][ref.key]))
    assert len(keys_file.tenants) == 2 and {t.priority for t in keys_file.tenants} == {"interactive", "batch"}
    served = parsed.model.served_model_name
    assert all(m in ("*", served) for t in keys_file.tenants for m in t.models)


def test_the_crd_refuses_both_api_key_references() -> None:
    """The CEL rule on spec.runtime (evaluated by the API server: test_tenant_real.py) and validate.py
    share one message."""
    from embedfleet.operator.crd.models import EXCLUSIVE_API_KEYS

    runtime = openapi_schema("EmbeddingDeployment")["properties"]["spec"]["properties"]["runtime"]
    assert runtime["x-kubernetes-validations"] == [
        {"rule": "!has(self.apiKeySecret) || !has(self.apiKeysSecret)", "message": EXCLUSIVE_API_KEYS}
    ]
    assert {"apiKeySecret", "apiKeysSecret"} <= set(runtime["properties"])
    assert runtime["properties"]["apiKeysSecret"]["required"] == ["name", "key"]


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("runtime", "engine"), "onnx", "spec.runtime.engine"),
        (("runtime", "maxBatchRequests"), 0, "spec.runtime.maxBatchRequests"),
        (("autoscaling", "targetUtilization"), 1.5, "spec.autoscaling.targetUtilization"),
        (("autoscaling", "minReplicas"), -1, "spec.autoscaling.minReplicas"),
        (("autoscaling", "inFlightPerReplica"), 0, "spec.autoscaling.inFlightPerReplica"),
        (("autoscaling", "inFlightPerReplica"), 4097, "spec.autoscaling.inFlightPerReplica"),
        (("model", "digest"), "md5:abc", "spec.model.digest"),
        (("model", "source"), "ftp://host/x", "spec.model.source"),
        (("runtime", "resources"), {"requests": {"cpu": "lots"}}, "spec.runtime.resources.requests.cpu"),
        (("placement", "policy"), "Random", "spec.placement.policy"),
        (("runtime", "maxQueueSeconds"), -1, "spec.runtime.maxQueueSeconds"),
        (("runtime", "maxQueueSeconds"), 0, "spec.runtime.maxQueueSeconds"),  # the runtime needs a bound
        (("runtime", "maxQueueSecondsBulk"), float("inf"), "spec.runtime.maxQueueSecondsBulk"),
        (("placement", "spillAfterSeconds"), -0.5, "spec.placement.spillAfterSeconds"),
        (("placement", "spillAfterSeconds"), float("inf"), "spec.placement.spillAfterSeconds"),
    ],
)
def test_schema_rejects_nonsense(path: tuple[str, str], value: Any, field: str) -> None:
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].setdefault(path[0], {})[path[1]] = value
    errors = cr_errors("EmbeddingDeployment", obj)
    assert errors and any(e.startswith(field) for e in errors), errors
    with pytest.raises(ValidationError):
        EmbeddingDeploymentSpec.model_validate(obj["spec"])


def test_server_side_defaults_equal_model_defaults() -> None:
    """What the API server fills in is what the operator would assume: one source of truth."""
    schema = openapi_schema("EmbeddingDeployment")
    defaulted = apply_defaults(schema, MINIMAL)
    assert cr_errors("EmbeddingDeployment", defaulted) == []
    from_server = EmbeddingDeploymentSpec.model_validate(defaulted["spec"])
    assert from_server == EmbeddingDeploymentSpec.model_validate(MINIMAL["spec"])
    # No server defaults: unset batching lets the runtime size it (for the GPU on GPUs: docs/gpu.md), and an
    # unset inFlightPerReplica lets the autoscaler fall back (autoscale_target.py).
    assert "maxBatchRequests" not in defaulted["spec"]["runtime"]
    assert "maxBatchTokens" not in defaulted["spec"]["runtime"]
    assert "inFlightPerReplica" not in defaulted["spec"]["autoscaling"]
    assert defaulted["spec"]["autoscaling"]["scaleDown"]["stabilizationWindowSeconds"] == 300


def test_autoscaling_spec_feeds_the_autoscaler() -> None:
    """The autoscaler reads spec.autoscaling by these camelCase names; defaults must agree."""
    dumped = AutoscalingSpec().model_dump(by_alias=True, exclude_none=True)
    config = autoscale.from_spec(dumped, in_flight_per_replica=32)
    assert config == autoscale.AutoscalerConfig(in_flight_per_replica=32)
    custom = AutoscalingSpec(min_replicas=2, max_replicas=5, target_utilization=1.0, scale_to_zero=True)
    config = autoscale.from_spec(custom.model_dump(by_alias=True, exclude_none=True))
    assert (config.min_replicas, config.max_replicas, config.target_per_replica, config.scale_to_zero) == (
        2,
        5,
        32.0,
        True,
    )
    own = AutoscalingSpec(in_flight_per_replica=8, target_utilization=0.5)
    config = autoscale.from_spec(own.model_dump(by_alias=True, exclude_none=True))
    assert (config.in_flight_per_replica, config.target_per_replica) == (8, 4.0)


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(-5, 5000),
    util=st.floats(-1, 2, allow_nan=False),
    engine=st.sampled_from(["torch", "trtllm", "vllm", ""]),
    replicas=st.one_of(st.none(), st.integers(-3, 20000)),
    in_flight=st.one_of(st.none(), st.integers(-3, 5000)),
)
def test_schema_and_model_agree(batch: int, util: float, engine: str, replicas: int | None,
                                in_flight: int | None) -> None:
    """For any value, kubectl (schema) and the operator (pydantic) accept or reject together."""
    obj = copy.deepcopy(MINIMAL)
    obj["spec"].update(
        {"runtime": {"maxBatchRequests": batch, "engine": engine}, "autoscaling": {"targetUtilization": util}}
    )
    if in_flight is not None:
        obj["spec"]["autoscaling"]["inFlightPerReplica"] = in_flight
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    schema_ok = not cr_errors("EmbeddingDeployment", obj)
    try:
        EmbeddingDeploymentSpec.model_validate(obj["spec"])
        model_ok = True
    except ValidationError:
        model_ok = False
    assert schema_ok == model_ok
