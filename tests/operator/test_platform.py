"""The platform allow-lists as pure rules (platform.py); the API server's CEL twin is in test_tenant_real.py."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator import platform
from embedfleet.operator.platform import PlatformPolicy, TolerationRule

_part = st.from_regex(r"[a-z0-9][a-z0-9.-]{0,12}", fullmatch=True)


@given(_part, _part, _part, st.sampled_from([":1", "@sha256:" + "ab" * 32, ":latest"]))
def test_a_path_prefix_allows_exactly_what_is_under_it(reg: str, path: str, repo: str, ref: str) -> None:
    allowed = [f"{reg}/{path}/"]
    assert platform.image_allowed(f"{reg}/{path}/{repo}{ref}", allowed)
    # A look-alike that only shares the characters (no '/' boundary) is someone else's registry path.
    assert not platform.image_allowed(f"{reg}/{path}{repo}x/{repo}{ref}", allowed)


@given(_part, _part, st.sampled_from([":1", "@sha256:" + "ab" * 32]))
def test_a_repository_entry_allows_its_tags_and_digests_only(reg: str, repo: str, ref: str) -> None:
    allowed = [f"{reg}/{repo}"]
    assert platform.image_allowed(f"{reg}/{repo}{ref}", allowed)
    assert platform.image_allowed(f"{reg}/{repo}", allowed)
    assert not platform.image_allowed(f"{reg}/{repo}-evil{ref}", allowed)
    assert not platform.image_allowed(f"{reg}/{repo}/sub{ref}", allowed)


def test_exact_and_wildcard_entries() -> None:
    assert platform.image_allowed("r/x:1", ["r/x:1"]) and not platform.image_allowed("r/x:2", ["r/x:1"])
    assert platform.image_allowed("anything/at:all", ["*"])
    assert not platform.image_allowed("r/x:1", [])


@given(st.sampled_from(["a", "b", "nvidia.com/gpu"]), st.sampled_from([None, "NoSchedule", "NoExecute"]),
       st.sampled_from([None, "NoSchedule", "NoExecute"]))
def test_toleration_rules(key: str, effect: str | None, rule_effect: str | None) -> None:
    rules = [TolerationRule(key="nvidia.com/gpu", effect=rule_effect)]
    toleration = {"key": key, "operator": "Exists", **({"effect": effect} if effect else {})}
    expected = key == "nvidia.com/gpu" and (rule_effect is None or effect == rule_effect)
    assert platform.toleration_allowed(toleration, rules) is expected
    # A toleration with no key tolerates every taint: only a '*' rule allows it.
    assert not platform.toleration_allowed({"operator": "Exists"}, rules)
    assert platform.toleration_allowed({"operator": "Exists"}, [TolerationRule(key="*")])


def test_each_forbidden_field_is_named() -> None:
    policy = PlatformPolicy()
    spec = {
        "runtime": {"image": "docker.io/evil/x:1", "tolerations": [{"operator": "Exists"}],
                    "nodeSelector": {"node-role.kubernetes.io/control-plane": ""}},
        "cache": {"storage": {"hostPath": "/proc"},
                  "nodePools": [{"name": "p", "nodeSelector": {"node-role.kubernetes.io/master": ""}}]},
    }
    problems = platform.deployment_problems(spec, policy)
    fields = sorted(p.split(":")[0] for p in problems)
    assert fields == ["spec.cache.nodePools[0].nodeSelector", "spec.cache.storage.hostPath",
                      "spec.runtime.image", "spec.runtime.nodeSelector", "spec.runtime.tolerations[0]"]
    assert platform.deployment_problems({"runtime": {"image": "ghcr.io/embedfleet/runtime:0.1.0"}}, policy) == []
    allow_cp = PlatformPolicy(allow_control_plane=True)
    assert not any("control-plane" in p for p in platform.deployment_problems(spec, allow_cp))


def test_host_path_only_the_platform_root() -> None:
    policy = PlatformPolicy(cache_root="/data/cache")
    assert platform.host_path_problems("f", None, policy) == []
    assert platform.host_path_problems("f", "/data/cache", policy) == []
    assert platform.host_path_problems("f", "/data/cache/", policy) == []
    for bad in ("/data", "/data/cache/../../etc", "/proc", "/", "/data/cache//"):
        assert platform.host_path_problems("f", bad, policy), bad


def test_secret_rules() -> None:
    policy = PlatformPolicy()
    assert platform.secret_problems("s", "ns", {"embedfleet.dev/tenant-secret": "true"}, policy) == []
    assert "not found" in platform.secret_problems("s", "ns", None, policy)[0]
    assert "embedfleet.dev/tenant-secret=true" in platform.secret_problems("s", "ns", {}, policy)[0]
    closed = PlatformPolicy(secrets=platform.SecretRules(allowed=False))
    assert platform.secret_problems("s", "ns", {"embedfleet.dev/tenant-secret": "true"}, closed)
    assert platform.deployment_problems({"runtime": {"apiKeySecret": {"name": "s", "key": "k"}}}, closed)


@pytest.mark.parametrize("field", platform.SECRET_REF_FIELDS)
def test_both_secret_references_follow_the_same_rules(field: str) -> None:
    """apiKeySecret (one key) and apiKeysSecret (a tenants keys file): the same allow-list and label,
    and each refusal names its own field."""
    where = f"spec.runtime.{field}"
    spec = {"runtime": {field: {"name": "s", "key": "k"}}}
    assert platform.deployment_problems(spec, PlatformPolicy()) == []
    closed = PlatformPolicy(secrets=platform.SecretRules(allowed=False))
    assert platform.deployment_problems(spec, closed) == [
        f"{where}: the platform does not let deployments reference Secrets"
    ]
    unlabelled = platform.secret_problems("s", "ns", {}, PlatformPolicy(), where=where)
    assert len(unlabelled) == 1 and unlabelled[0].startswith(where + ":")
    assert "embedfleet.dev/tenant-secret=true" in unlabelled[0]
    assert platform.secret_problems("s", "ns", None, PlatformPolicy(), where=where)[0].startswith(where + ":")
    labelled = {"embedfleet.dev/tenant-secret": "true"}
    assert platform.secret_problems("s", "ns", labelled, PlatformPolicy(), where=where) == []
    assert platform.secret_problems("s", "ns", labelled, closed, where=where)[0].startswith(where + ":")


def test_load_reads_the_charts_json_and_refuses_garbage() -> None:
    assert platform.load({}) == PlatformPolicy(runtime_image=platform.BUILTIN_RUNTIME_IMAGE)
    policy = platform.load({platform.ENV: json.dumps({
        "allowedImages": ["r/"], "allowedTolerations": [{"key": "k"}], "cacheRoot": "/c",
        "secrets": {"allowed": False, "requiredLabels": {}}, "allowControlPlane": False})})
    assert policy.allowed_images == ["r/"] and policy.cache_root == "/c" and not policy.secrets.allowed
    with pytest.raises(SystemExit, match="not a valid platform policy"):
        platform.load({platform.ENV: "{not json"})
    with pytest.raises(SystemExit, match="not a valid platform policy"):
        platform.load({platform.ENV: json.dumps({"allowedImages": "r/", "bogus": 1})})


def test_the_default_runtime_image_comes_from_the_chart_else_is_built_in() -> None:
    assert platform.load({}).runtime_image == platform.BUILTIN_RUNTIME_IMAGE
    assert platform.load({platform.RUNTIME_IMAGE_ENV: " "}).runtime_image == platform.BUILTIN_RUNTIME_IMAGE
    loaded = platform.load({platform.RUNTIME_IMAGE_ENV: "mirror.example/runtime:3",
                            platform.ENV: json.dumps({"allowedImages": ["mirror.example/"]})})
    assert loaded.runtime_image == "mirror.example/runtime:3" and loaded.allowed_images == ["mirror.example/"]
    assert platform.runtime_image("r/x:1", "r/y:2") == "r/x:1"
    assert platform.runtime_image(None, "r/y:2") == "r/y:2"
    assert platform.runtime_image(None, None) == platform.BUILTIN_RUNTIME_IMAGE


def test_the_allow_list_applies_to_the_default_image_of_a_spec_that_names_none() -> None:
    mirror_only = ["mirror.example/"]
    refused = PlatformPolicy(allowed_images=mirror_only, runtime_image="ghcr.io/embedfleet/runtime:1")
    (problem,) = platform.deployment_problems({"runtime": {}}, refused)
    assert problem.startswith("spec.runtime.image: unset") and "'ghcr.io/embedfleet/runtime:1'" in problem
    assert platform.deployment_problems({}, refused) == [problem]
    # Named and allowed: the default does not matter.
    assert platform.deployment_problems({"runtime": {"image": "mirror.example/runtime:1"}}, refused) == []
    allowed = PlatformPolicy(allowed_images=mirror_only, runtime_image="mirror.example/runtime:1")
    assert platform.deployment_problems({"runtime": {}}, allowed) == []
    # A hub reading a spoke's published rules does not know the spoke's default: not checked there.
    assert platform.deployment_problems({"runtime": {}}, PlatformPolicy(allowed_images=mirror_only)) == []


def test_the_default_image_is_never_published_with_the_rules() -> None:
    """A spoke's heartbeat carries its rules as JSON; hubs of another version must still read them."""
    policy = platform.load({platform.RUNTIME_IMAGE_ENV: "mirror.example/runtime:3"})
    published = policy.model_dump_json(by_alias=True)
    assert "runtime" not in json.loads(published) and "runtimeImage" not in json.loads(published)
    assert PlatformPolicy.model_validate_json(published).runtime_image is None


def test_the_charts_defaults_are_the_operators_defaults() -> None:
    """values.yaml's platform block, passed as JSON, is exactly PlatformPolicy()'s defaults."""
    import yaml
    from tests.kube.controlplane import ROOT

    values = yaml.safe_load((ROOT / "charts" / "embedfleet" / "values.yaml").read_text())
    assert PlatformPolicy.model_validate(values["platform"]) == PlatformPolicy()


def test_the_example_values_reach_the_operator_as_its_policy() -> None:
    """examples/platform-values.yaml through `helm template`: the operator's EMBEDFLEET_PLATFORM_POLICY
    is that file's platform block, and both allow-list policies and the node cache's volume and claim ones
    are rendered."""
    import yaml
    from tests.chart.helm import by_kind, operator_container, template
    from tests.kube.controlplane import ROOT

    path = ROOT / "examples" / "platform-values.yaml"
    objects = template([path])
    env = {e["name"]: e.get("value") for e in operator_container(objects)["env"]}
    policy = platform.load(env)
    expected = PlatformPolicy.model_validate(yaml.safe_load(path.read_text())["platform"])
    app_version = yaml.safe_load((ROOT / "charts" / "embedfleet" / "Chart.yaml").read_text())["appVersion"]
    # the chart adds its default runtime image (runtimeImage) to the platform block it is given
    assert policy == expected.model_copy(update={"runtime_image": f"ghcr.io/embedfleet/runtime:{app_version}"})
    assert policy.cache_root == "/mnt/nvme/embedfleet-cache"
    names = sorted(o["metadata"]["name"].rsplit("embedfleet-", 1)[-1]
                   for o in by_kind(objects, "ValidatingAdmissionPolicy"))
    assert names == ["cache-claims", "cache-volumes", "cache-weights", "embeddingdeployments", "modelcaches"], names
    assert len(by_kind(objects, "ValidatingAdmissionPolicyBinding")) == 5
    off = template([path], sets={"admissionPolicy.enabled": "false"})
    assert by_kind(off, "ValidatingAdmissionPolicy") == []


def test_admit_checks_each_referenced_secrets_labels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The operator's admission (no API server): a Secret named by apiKeysSecret must exist and carry the
    platform's label, and only its metadata is asked for."""
    from embedfleet.operator.handlers import embedding

    labelled = {"embedfleet.dev/tenant-secret": "true"}
    secrets = {"tenants": labelled, "plain": {}}
    asked: list[tuple[str, str, str]] = []

    class FakeKube:
        def get_metadata(self, kind: str, name: str, namespace: str) -> dict[str, Any] | None:
            asked.append((kind, name, namespace))
            return None if name not in secrets else {"metadata": {"name": name, "labels": secrets[name]}}

    monkeypatch.setattr(embedding, "KUBE", FakeKube())
    monkeypatch.setattr(embedding, "POLICY", PlatformPolicy())

    def admit(runtime: dict[str, Any]) -> tuple[Any, list[str]]:
        spec = {"model": {"source": "hf://BAAI/bge-small-en-v1.5", "digest": "sha256:" + "0f" * 32},
                "runtime": runtime}
        return embedding.admit({"metadata": {"name": "bge", "namespace": "team"}, "spec": spec})

    parsed, problems = admit({"apiKeysSecret": {"name": "tenants", "key": "keys.yaml"}})
    assert problems == [] and parsed is not None and parsed.runtime.api_keys_secret is not None
    assert asked == [("Secret", "tenants", "team")]
    parsed, problems = admit({"apiKeysSecret": {"name": "plain", "key": "keys.yaml"}})
    assert parsed is None and len(problems) == 1
    assert problems[0].startswith("spec.runtime.apiKeysSecret: Secret 'plain' lacks the label(s)")
    parsed, problems = admit({"apiKeysSecret": {"name": "nope", "key": "keys.yaml"}})
    assert parsed is None and problems[0].startswith("spec.runtime.apiKeysSecret: Secret 'nope' not found")
    # Both references: refused by validation before any Secret is read.
    asked.clear()
    parsed, problems = admit({"apiKeySecret": {"name": "tenants", "key": "k"},
                              "apiKeysSecret": {"name": "tenants", "key": "keys.yaml"}})
    assert parsed is None and any("mutually exclusive" in p for p in problems) and asked == []
    monkeypatch.setattr(embedding, "POLICY", PlatformPolicy(secrets=platform.SecretRules(allowed=False)))
    parsed, problems = admit({"apiKeysSecret": {"name": "tenants", "key": "keys.yaml"}})
    assert parsed is None
    assert problems == ["spec.runtime.apiKeysSecret: the platform does not let deployments reference Secrets"]
