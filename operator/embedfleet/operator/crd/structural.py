"""Pydantic JSON Schema -> Kubernetes structural openAPIV3Schema, and the CRD document around it.

The API server accepts only "structural" schemas: no ``$ref``, no ``additionalProperties: false``, no
JSON-Schema-2020 numeric exclusives, ``nullable`` instead of ``anyOf [T, null]``. Pydantic emits the
modern dialect, so this module rewrites it once, at generation time. The kinds' CRDs are built from these
pieces in schema.py (EmbeddingDeployment, ModelCache) and fleet.py (the hub's kinds): a leaf both import,
so neither imports the other's helpers back.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from embedfleet.operator.crd import naming

_DROP = {"title", "additionalProperties", "$defs"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict) and "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _resolve(merged, defs)
    return node


def structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Rewrite one (sub)schema into the structural OpenAPI v3 form the API server requires."""
    node = _resolve(node, defs)
    out: dict[str, Any] = {}

    any_of = node.get("anyOf")
    if any_of is not None and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in any_of if b.get("type") != "null"]
        if len(branches) != 1:
            raise ValueError(f"cannot express anyOf {any_of!r} as a structural schema")
        inner = structural(branches[0], defs)
        out.update(inner)
        if len(branches) != len(any_of):
            out["nullable"] = True
        for key in ("description", "default"):
            if key in node and node[key] is not None:
                out[key] = node[key]
        return out

    for key, value in node.items():
        if key in _DROP or key == "anyOf":
            continue
        if key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum":
            out["minimum"] = value
            out["exclusiveMinimum"] = True
        elif key == "exclusiveMaximum":
            out["maximum"] = value
            out["exclusiveMaximum"] = True
        elif key == "properties":
            out["properties"] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out["items"] = structural(value, defs)
        else:
            out[key] = value

    if node.get("x-kubernetes-int-or-string"):
        # The API server's one allowed typed anyOf is exactly [integer, string] beside
        # x-kubernetes-int-or-string (what controller-gen emits for resource.Quantity); anything more in a
        # branch (a pattern) makes the schema non-structural, so string constraints move onto the node.
        for branch in node.get("anyOf", []):
            for key, value in branch.items():
                if key != "type":
                    out[key] = value
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        out.pop("type", None)
    extra = node.get("additionalProperties")
    if isinstance(extra, dict):
        out["additionalProperties"] = structural(extra, defs)
    if out.get("type") == "object" and "properties" in out:
        required = set(out.get("required", []))
        for name, sub in out["properties"].items():
            # A nested object whose fields all have defaults defaults to {} itself, so the API server
            # fills in the nested defaults even when the user leaves the whole block out.
            if (
                name not in required
                and "default" not in sub
                and sub.get("type") == "object"
                and "properties" in sub
                and not sub.get("required")
            ):
                sub["default"] = {}
    return out


def model_schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return structural(raw, raw.get("$defs", {}))


def root_schema(spec: type[BaseModel], status: type[BaseModel]) -> dict[str, Any]:
    status_schema = model_schema(status)
    # kopf keeps its own progress under status.kopf; without this the API server would prune it.
    status_schema["properties"]["kopf"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    spec_schema = model_schema(spec)
    spec_schema.pop("default", None)
    return {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec_schema,
            "status": status_schema,
        },
    }


def crd_document(
    *,
    kind: str,
    plural: str,
    singular: str,
    short_names: tuple[str, ...],
    scope: str,
    schema: dict[str, Any],
    columns: list[dict[str, Any]],
    subresources: dict[str, Any],
) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{plural}.{naming.GROUP}",
            "labels": {"app.kubernetes.io/part-of": "embedfleet"},
        },
        "spec": {
            "group": naming.GROUP,
            "scope": scope,
            "names": {
                "kind": kind,
                "listKind": f"{kind}List",
                "plural": plural,
                "singular": singular,
                "shortNames": list(short_names),
                "categories": ["embedfleet"],
            },
            "versions": [
                {
                    "name": naming.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": subresources,
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def condition_column(name: str, priority: int) -> dict[str, Any]:
    return {
        "name": name,
        "type": "string",
        "jsonPath": f'.status.conditions[?(@.type=="{name}")].status',
        "priority": priority,
    }
