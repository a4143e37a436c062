"""The platform's allow-lists: what a tenant's EmbeddingDeployment or ModelCache may ask the operator for.

The operator creates pods with its own rights, so every field that reaches a pod spec is a way past
the tenant's own rights unless the platform bounds it (a confused deputy): which images run, which
host path is mounted, which Secrets are referenced, which taints are tolerated, which nodes are
targeted. The platform team sets the bounds once in the chart's ``platform`` values; the chart hands
them to the operator as JSON (``EMBEDFLEET_PLATFORM_POLICY``) and renders the *same* rules as a
``ValidatingAdmissionPolicy`` (CEL, templates/admission-policy.yaml), so a forbidden spec is refused by
the API server at ``kubectl apply`` and, where that policy is absent, by the operator's validation
(``Accepted=False``, nothing created). tests/operator/test_tenant_real.py checks that the two agree.

The platform also chooses the runtime image of every deployment that does not name one: the chart's
``runtimeImage`` values (``EMBEDFLEET_DEFAULT_RUNTIME_IMAGE``), else this package's own release of the runtime
image. The allow-list applies to that image too, since it is what the pods run.

Pure: no I/O. Secret labels need a read, so `secret_problems` takes the labels the caller fetched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from pydantic.alias_generators import to_camel

from embedfleet.operator import spot

ENV = "EMBEDFLEET_PLATFORM_POLICY"
#: The runtime image of deployments that name none (chart values runtimeImage.repository and .tag).
RUNTIME_IMAGE_ENV = "EMBEDFLEET_DEFAULT_RUNTIME_IMAGE"
RUNTIME_REPOSITORY = "ghcr.io/embedfleet/runtime"
DEFAULT_CACHE_ROOT = "/var/lib/embedfleet/cache"
DEFAULT_IMAGE_PREFIX = "ghcr.io/embedfleet/"
DEFAULT_SECRET_LABEL = "embedfleet.dev/tenant-secret"
#: The spec.runtime fields that reference a Secret (camelCase, as stored); the same rules govern each.
SECRET_REF_FIELDS = ("apiKeySecret", "apiKeysSecret")
#: Node labels that mark control-plane nodes; tenants' pods never target them.
CONTROL_PLANE_LABELS = ("node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master")


def _package_version() -> str:
    try:
        return metadata.version("embedfleet")
    except metadata.PackageNotFoundError:  # a source tree run without installing it
        return "latest"


#: The runtime release that goes with this operator: its image is the default when neither the spec
#: nor the platform names one.
BUILTIN_RUNTIME_IMAGE = f"{RUNTIME_REPOSITORY}:{_package_version()}"


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class TolerationRule(_Camel):
    """A toleration tenants may use: same key, and the same effect unless the rule leaves it open."""

    key: str = Field(min_length=1, description="Taint key; '*' allows a toleration of every taint.")
    effect: str | None = None


class SecretRules(_Camel):
    allowed: bool = Field(
        default=True, description="May spec.runtime.apiKeySecret / apiKeysSecret be set at all?"
    )
    required_labels: dict[str, str] = Field(
        default_factory=lambda: {DEFAULT_SECRET_LABEL: "true"},
        description="Labels the referenced Secret (in the deployment's own namespace) must carry.",
    )


class SpotTaint(_Camel):
    key: str = Field(min_length=1, max_length=253)
    value: str = Field(default="", max_length=63)


class SpotRules(_Camel):
    """spec.spot's view of the nodes (docs/spot.md): the platform's, never a tenant's. A list given here
    replaces the built-in one; an empty one (the chart's default) is the built-in one."""

    node_labels: dict[str, str] = Field(
        default_factory=lambda: dict(spot.SPOT_NODE_LABELS),
        description="A node carrying any one of these labels (key: value) is spot.",
    )
    taints: list[SpotTaint] = Field(
        default_factory=lambda: [SpotTaint(key=k, value=v) for k, v in spot.SPOT_TAINTS],
        description="NoSchedule taints of spot pools; spot pods tolerate them (key=value).",
    )
    reclaim_taints: list[str] = Field(
        default_factory=lambda: list(spot.RECLAIM_TAINTS),
        description="Node taint keys that announce a reclaim (a termination notice) or a removal.",
    )

    @field_validator("node_labels", "taints", "reclaim_taints", mode="before")
    @classmethod
    def _empty_is_built_in(cls, value: Any, info: ValidationInfo) -> Any:
        if value:
            return value
        return {"node_labels": dict(spot.SPOT_NODE_LABELS),
                "taints": [{"key": k, "value": v} for k, v in spot.SPOT_TAINTS],
                "reclaim_taints": list(spot.RECLAIM_TAINTS)}[str(info.field_name)]

    def taint_pairs(self) -> tuple[tuple[str, str], ...]:
        return tuple((t.key, t.value) for t in self.taints)


class PlatformPolicy(_Camel):
    allowed_images: list[str] = Field(
        default_factory=lambda: [DEFAULT_IMAGE_PREFIX],
        description="'reg/path/' (ends in /): every image under it; 'reg/repo': any tag or digest of that "
        "repository; 'reg/repo:tag' or 'reg/repo@sha256:...': exactly that; '*': every image.",
    )
    allowed_tolerations: list[TolerationRule] = Field(
        default_factory=lambda: [TolerationRule(key="nvidia.com/gpu")]
    )
    secrets: SecretRules = Field(default_factory=SecretRules)
    cache_root: str = Field(default=DEFAULT_CACHE_ROOT, pattern=r"^/[^\s]*[^/\s]$|^/$")
    allow_control_plane: bool = Field(
        default=False, description="May runtime pods and caches target control-plane nodes?"
    )
    spot: SpotRules = Field(
        default_factory=SpotRules, exclude=True,
        description="Which nodes are spot and what announces a reclaim; not part of the rules a spoke "
        "publishes to its hub (a hub of another version reads them).",
    )
    runtime_image: str | None = Field(
        default=None,
        min_length=1,
        exclude=True,
        description="The image of runtimes whose spec.runtime.image is unset (load() sets it). None: not "
        "known here, as a hub reading a spoke's published rules (never part of them, so hubs and spokes "
        "of other versions still read each other's), and then such a spec's image is not checked.",
    )


def load(environ: Mapping[str, str] | None = None) -> PlatformPolicy:
    """The policy the chart passed in (the safe defaults above when run without one), with the
    platform's default runtime image: ``EMBEDFLEET_DEFAULT_RUNTIME_IMAGE``, else BUILTIN_RUNTIME_IMAGE."""
    environ = os.environ if environ is None else environ
    raw = environ.get(ENV, "").strip()
    image = environ.get(RUNTIME_IMAGE_ENV, "").strip() or BUILTIN_RUNTIME_IMAGE
    try:
        policy = PlatformPolicy.model_validate(json.loads(raw)) if raw else PlatformPolicy()
    except (ValueError, ValidationError) as exc:
        raise SystemExit(f"{ENV} is not a valid platform policy: {exc}") from exc
    return policy.model_copy(update={"runtime_image": image})


def runtime_image(spec_image: str | None, default_image: str | None) -> str:
    """The image a deployment's runtime pods run: its own ``spec.runtime.image`` when set, else the
    platform's default, else the runtime release that goes with this operator."""
    return spec_image or default_image or BUILTIN_RUNTIME_IMAGE


# ---------------------------------------------------------------- single rules


def image_allowed(image: str, allowed: list[str]) -> bool:
    """Prefix entries must end in '/': 'ghcr.io/embedfleet' would also allow 'ghcr.io/embedfleet-evil'."""
    for entry in allowed:
        if entry == "*" or image == entry:
            return True
        if entry.endswith("/") and image.startswith(entry):
            return True
        if not entry.endswith("/") and image.startswith((entry + ":", entry + "@")):
            return True
    return False


def toleration_allowed(toleration: Mapping[str, Any], rules: list[TolerationRule]) -> bool:
    key, effect = toleration.get("key"), toleration.get("effect")
    for rule in rules:
        key_ok = rule.key == "*" or (key is not None and key == rule.key)
        effect_ok = rule.effect is None or (effect is not None and effect == rule.effect)
        if key_ok and effect_ok:
            return True
    return False


def _describe(toleration: Mapping[str, Any]) -> str:
    parts = [f"{k}={toleration[k]}" for k in ("key", "operator", "value", "effect") if toleration.get(k)]
    return "{" + ", ".join(parts) + "}" if parts else "{} (every taint)"


def selector_problems(where: str, selector: Mapping[str, str], policy: PlatformPolicy) -> list[str]:
    if policy.allow_control_plane:
        return []
    return [
        f"{where}: {key} targets control-plane nodes, which the platform reserves"
        for key in selector
        if key in CONTROL_PLANE_LABELS
    ]


def host_path_problems(where: str, host_path: str | None, policy: PlatformPolicy) -> list[str]:
    if host_path is None or host_path in (policy.cache_root, policy.cache_root + "/"):
        return []
    return [
        f"{where}: {host_path!r} is not allowed: the node cache root is fixed by the platform "
        f"({policy.cache_root}); leave the field out"
    ]


# ---------------------------------------------------------------- whole specs


def _get(raw: Mapping[str, Any], *path: str) -> Any:
    node: Any = raw
    for part in path:
        if not isinstance(node, Mapping):
            return None
        node = node.get(part)
    return node


def _pool_selectors(raw_cache: Mapping[str, Any] | None, where: str) -> list[tuple[str, Mapping[str, str]]]:
    out: list[tuple[str, Mapping[str, str]]] = []
    if not isinstance(raw_cache, Mapping):
        return out
    out.append((f"{where}.nodeSelector", raw_cache.get("nodeSelector") or {}))
    for i, pool in enumerate(raw_cache.get("nodePools") or []):
        if isinstance(pool, Mapping):
            out.append((f"{where}.nodePools[{i}].nodeSelector", pool.get("nodeSelector") or {}))
    return out


def deployment_problems(raw_spec: Mapping[str, Any], policy: PlatformPolicy) -> list[str]:
    """Everything in an EmbeddingDeployment spec (camelCase, as stored) outside the allow-lists.

    Works on the raw spec, like the admission policy does, so both see exactly the same fields. An unset
    image is the platform's default (``policy.runtime_image``), checked too: the operator never renders an
    image the allow-list refuses.
    """
    problems: list[str] = []
    runtime = _get(raw_spec, "runtime") or {}
    image = runtime.get("image")
    allowed = ", ".join(policy.allowed_images) or "none"
    if isinstance(image, str) and not image_allowed(image, policy.allowed_images):
        problems.append(f"spec.runtime.image: {image!r} is not from a registry the platform allows ({allowed})")
    elif image is None and policy.runtime_image and not image_allowed(policy.runtime_image, policy.allowed_images):
        problems.append(
            f"spec.runtime.image: unset, and the platform's default runtime image {policy.runtime_image!r} "
            f"is not from a registry the platform allows ({allowed}): name an allowed image, or have the "
            "platform's runtimeImage and allowedImages agree"
        )
    for i, toleration in enumerate(runtime.get("tolerations") or []):
        if isinstance(toleration, Mapping) and not toleration_allowed(toleration, policy.allowed_tolerations):
            allowed = ", ".join(r.key + (f":{r.effect}" if r.effect else "") for r in policy.allowed_tolerations)
            problems.append(
                f"spec.runtime.tolerations[{i}]: {_describe(toleration)} is not allowed by the platform "
                f"(allowed keys: {allowed or 'none'})"
            )
    for ref in SECRET_REF_FIELDS:
        if runtime.get(ref) is not None and not policy.secrets.allowed:
            problems.append(f"spec.runtime.{ref}: the platform does not let deployments reference Secrets")
    problems += selector_problems("spec.runtime.nodeSelector", runtime.get("nodeSelector") or {}, policy)
    for where, selector in _pool_selectors(_get(raw_spec, "cache"), "spec.cache"):
        problems += selector_problems(where, selector, policy)
    problems += host_path_problems(
        "spec.cache.storage.hostPath", _get(raw_spec, "cache", "storage", "hostPath"), policy
    )
    return problems


def model_cache_problems(raw_spec: Mapping[str, Any], policy: PlatformPolicy) -> list[str]:
    problems: list[str] = []
    for where, selector in _pool_selectors(raw_spec, "spec"):
        problems += selector_problems(where, selector, policy)
    problems += host_path_problems("spec.storage.hostPath", _get(raw_spec, "storage", "hostPath"), policy)
    return problems


def secret_problems(
    secret_name: str,
    namespace: str,
    labels: Mapping[str, str] | None,
    policy: PlatformPolicy,
    where: str = "spec.runtime.apiKeySecret",
) -> list[str]:
    """The referenced Secret must exist in the deployment's namespace and carry the platform's labels.

    ``labels`` is None when the Secret does not exist (or the operator may not read it); ``where`` is the
    field that names it (one of SECRET_REF_FIELDS under spec.runtime).
    """
    if not policy.secrets.allowed:
        return [f"{where}: the platform does not let deployments reference Secrets"]
    if labels is None:
        return [f"{where}: Secret {secret_name!r} not found in namespace {namespace!r}"]
    missing = {k: v for k, v in policy.secrets.required_labels.items() if labels.get(k) != v}
    if missing:
        wanted = ", ".join(f"{k}={v}" for k, v in sorted(missing.items()))
        return [
            f"{where}: Secret {secret_name!r} lacks the label(s) {wanted} that the platform requires "
            "of Secrets deployments may use"
        ]
    return []
