"""The gateway's optional Gateway API HTTPRoute: rendered by the real `helm` (off by default, attached to
the Gateways, routed to the gateway Service, the values schema against the pinned Gateway API), then
applied for real against the Gateway API's own CRDs, and broken copies refused by the API server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helm import CHART, CI_VALUES, DEFAULTS, SCHEMA, by_kind, helm, named, template
from tests.chart.render_helpers import CASES, IDS
from tests.kube import gateway_api
from tests.kube.controlplane import Cluster

# ---------------------------------------------------------------- what renders


def route_values(tmp_path: Path, **route: Any) -> Path:
    """A values file turning the HTTPRoute on with `route` (lists of maps are awkward with --set)."""
    path = tmp_path / f"route-values-{len(list(tmp_path.glob('route-values-*')))}.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"httpRoute": {"enabled": True, **route}}}))
    return path


SHARED_GATEWAY = [{"name": "shared", "namespace": "gateway-infra", "sectionName": "https"}, {"name": "local"}]


@pytest.mark.parametrize(("name", "files", "sets"), CASES, ids=IDS)
def test_no_httproute_unless_asked(name: str, files: list[Path], sets: dict[str, str]) -> None:
    """Off by default: a cluster without the Gateway API CRDs installs the chart as before."""
    assert DEFAULTS["gateway"]["httpRoute"]["enabled"] is False
    assert not by_kind(template(files, sets), "HTTPRoute")


@pytest.mark.parametrize("role", ["standalone", "spoke"])
def test_httproute_attaches_to_the_gateways_and_routes_to_the_gateway_service(tmp_path: Path, role: str) -> None:
    values = route_values(tmp_path, parentRefs=SHARED_GATEWAY, hostnames=["embed.example.com", "*.ml.example.com"])
    objects = template([CI_VALUES[role], values], {"gateway.service.port": "8081"}, release="search",
                       namespace="ops")
    (route,) = by_kind(objects, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["metadata"]["namespace"] == "ops"
    service = named(objects, "Service", "search-embedfleet-gateway")
    assert route["metadata"]["name"] == service["metadata"]["name"]
    spec = route["spec"]
    assert spec["parentRefs"] == [
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "shared", "namespace": "gateway-infra",
         "sectionName": "https"},
        {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "local"},
    ]
    assert spec["hostnames"] == ["embed.example.com", "*.ml.example.com"]
    (rule,) = spec["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    (backend,) = rule["backendRefs"]
    (port,) = service["spec"]["ports"]
    assert backend == {"group": "", "kind": "Service", "name": service["metadata"]["name"], "port": port["port"]}
    assert port["port"] == 8081
    assert "timeouts" not in rule

    narrow = template([route_values(tmp_path, parentRefs=[{"name": "gw"}], pathPrefixes=["/v1", "/rerank"],
                                    requestTimeout="90s")], {"role": role})
    (route,) = by_kind(narrow, "HTTPRoute")
    assert "hostnames" not in route["spec"]
    (rule,) = route["spec"]["rules"]
    assert [m["path"]["value"] for m in rule["matches"]] == ["/v1", "/rerank"]
    assert rule["timeouts"] == {"request": "90s"}


def test_httproute_needs_parent_refs(tmp_path: Path) -> None:
    done = helm("template", "x", str(CHART), "-f", str(route_values(tmp_path, hostnames=["a.example.com"])),
                check=False)
    assert done.returncode != 0
    assert "gateway.httpRoute.enabled needs gateway.httpRoute.parentRefs" in done.stderr, done.stderr


def test_httproute_only_where_the_gateway_runs(tmp_path: Path) -> None:
    """A hub runs no gateway, so it renders no route (even with the route on and no parentRefs); neither
    does a cluster with the gateway turned off."""
    values = route_values(tmp_path, parentRefs=[{"name": "gw"}])
    assert not by_kind(template([CI_VALUES["hub"], values]), "HTTPRoute")
    assert not by_kind(template([CI_VALUES["hub"], route_values(tmp_path)]), "HTTPRoute")
    assert not by_kind(template([values], {"gateway.enabled": "false"}), "HTTPRoute")
    assert len(by_kind(template([values]), "HTTPRoute")) == 1


def test_httproute_values_schema_follows_the_gateway_api(tmp_path: Path) -> None:
    """The values schema refuses what the pinned Gateway API's HTTPRoute CRD refuses, with its own patterns
    and limits (so a bump of the pin that changes them shows here)."""
    (version,) = [v for v in gateway_api.crd("httproutes")["spec"]["versions"] if v["name"] == "v1"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    ours = SCHEMA["properties"]["gateway"]["properties"]["httpRoute"]["properties"]
    hostname = spec["hostnames"]["items"]
    assert (ours["hostnames"]["items"]["pattern"], ours["hostnames"]["items"]["maxLength"]) == (
        hostname["pattern"], hostname["maxLength"])
    assert ours["hostnames"]["maxItems"] == spec["hostnames"]["maxItems"]
    parent = spec["parentRefs"]["items"]["properties"]
    for key in ("name", "namespace", "sectionName"):
        theirs = {k: parent[key][k] for k in ("pattern", "minLength", "maxLength") if k in parent[key]}
        assert {k: ours["parentRefs"]["items"]["properties"][key].get(k) for k in theirs} == theirs, key
    assert ours["parentRefs"]["maxItems"] == spec["parentRefs"]["maxItems"]
    timeout = spec["rules"]["items"]["properties"]["timeouts"]["properties"]["request"]["pattern"]
    assert ours["requestTimeout"]["pattern"] == f"^$|{timeout}"


# ---------------------------------------------------------------- judged by the API server


def _rendered_route(tmp_path: Path, release: str, namespace: str, **route: Any) -> dict[str, Any]:
    (found,) = by_kind(template([route_values(tmp_path, **route)], release=release, namespace=namespace),
                       "HTTPRoute")
    return dict(found)


def test_httproute_is_accepted_by_the_api_server(kube_cluster: Cluster, unique: str, tmp_path: Path) -> None:
    """The rendered HTTPRoute, applied for real (server-side apply, strict field validation) against the
    pinned Gateway API CRDs, attached to a Gateway in another namespace: the server accepts it and keeps
    what the chart wrote. No Gateway controller runs on the test control plane, so nobody reconciles the
    Gateway or the route: no `Accepted` / `ResolvedRefs` conditions appear and none are asserted; what a
    real Gateway does with the route is not verified here."""
    cluster = kube_cluster
    gateway_api.install(cluster)
    namespace, infra, klass = f"route-{unique}", f"infra-{unique}", f"embedfleet-test-{unique}"
    for ns in (namespace, infra):
        cluster.kubectl("create", "namespace", ns)
    try:
        cluster.apply(
            {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": {"name": klass},
             "spec": {"controllerName": "example.com/no-controller-runs"}},
            {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
             "metadata": {"name": "shared", "namespace": infra},
             "spec": {"gatewayClassName": klass, "listeners": [
                 {"name": "http", "protocol": "HTTP", "port": 80, "allowedRoutes": {"namespaces": {"from": "All"}}}]}},
        )
        route = _rendered_route(tmp_path, f"r-{unique}", namespace,
                                parentRefs=[{"name": "shared", "namespace": infra, "sectionName": "http"}],
                                hostnames=["embed.example.com"], pathPrefixes=["/v1", "/embed"],
                                requestTimeout="90s")
        done = cluster.kubectl("apply", "--server-side", "--validate=strict", "-f", "-",
                               input=json.dumps(route), check=False)
        assert done.returncode == 0, done.stderr
        stored = cluster.get_json("httproute.gateway.networking.k8s.io", route["metadata"]["name"], "-n", namespace)
        assert stored["spec"]["parentRefs"] == route["spec"]["parentRefs"]
        assert stored["spec"]["hostnames"] == ["embed.example.com"]
        (rule,) = stored["spec"]["rules"]
        assert rule["matches"] == route["spec"]["rules"][0]["matches"]
        (backend,) = rule["backendRefs"]
        assert backend.items() >= route["spec"]["rules"][0]["backendRefs"][0].items()
        assert backend["weight"] == 1  # the CRD's default: the server applied the real schema
        assert rule["timeouts"] == {"request": "90s"}
        assert not (stored.get("status") or {}).get("parents")  # no controller: nobody wrote status
    finally:
        cluster.kubectl("delete", "gatewayclass.gateway.networking.k8s.io", klass, "--wait=false",
                        "--ignore-not-found")
        cluster.kubectl("delete", "namespace", namespace, infra, "--wait=false")


def _break(route: dict[str, Any], field: str, value: Any) -> dict[str, Any]:
    """A copy of `route` with the field at the dotted path (list indexes as numbers) set to `value`."""
    out = json.loads(json.dumps(route))
    *parents, last = field.split(".")
    node: Any = out
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(last) if last.isdigit() else last] = value
    return out


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("spec.rules.0.backendRefs.0.port", 70000, "backendRefs[0].port"),
        ("spec.hostnames.0", "Embed_Host.example.com", "hostnames[0]"),
        ("spec.rules.0.timeouts.request", "90 seconds", "timeouts.request"),
        ("spec.rules.0.matches.0.path.type", "Prefix", "path.type"),
    ],
    ids=["backend-port-out-of-range", "bad-hostname", "bad-duration", "unknown-match-type"],
)
def test_api_server_refuses_a_broken_httproute(kube_cluster: Cluster, unique: str, tmp_path: Path, field: str,
                                               value: Any, says: str) -> None:
    """The check above can fail: the same route with one field the Gateway API forbids is refused
    (dry run, nothing created), naming the field; unbroken, the same dry run passes."""
    gateway_api.install(kube_cluster, ("httproutes",))
    route = _rendered_route(tmp_path, f"b-{unique}", "default", parentRefs=[{"name": "gw"}],
                            hostnames=["embed.example.com"], requestTimeout="90s")

    def dry_run(obj: dict[str, Any]) -> Any:
        return kube_cluster.kubectl("apply", "--dry-run=server", "--validate=strict", "-f", "-",
                                    input=json.dumps(obj), check=False)

    assert dry_run(route).returncode == 0
    done = dry_run(_break(route, field, value))
    assert done.returncode != 0, done.stdout
    assert "is invalid" in done.stderr and says in done.stderr, done.stderr
