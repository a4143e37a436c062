"""The hub's identity on a spoke (templates/hub-access.yaml) judged by a real API server: what RBAC grants it
(a SelfSubjectRulesReview made as it), and the calls the hub's watch-driven loop makes, made as it.

The point a render test cannot settle: the heartbeat Lease rule names one Lease (``resourceNames``) and
still allows ``list`` and ``watch``. The API server takes the name of a collection request from an exact
``metadata.name`` field selector and authorizes it against ``resourceNames``; without that selector, or
naming another Lease, the same request is refused. So the hub watches its heartbeat and cannot read the
spoke operator's leader-election Lease beside it.
"""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from tests.chart.helm import CI_VALUES, install_crds, rights, template
from tests.kube.controlplane import Cluster, wait_until

HEARTBEAT = "embedfleet-spoke"
LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
EDS = "/apis/embedfleet.dev/v1alpha1/embeddingdeployments"

COPIES = {("embeddingdeployments.embedfleet.dev", "", v)
          for v in ("get", "list", "watch", "create", "patch", "delete")}
NAMESPACES = {("namespaces", "", v) for v in ("get", "create")}
SECRETS = {("secrets", "", v) for v in ("get", "create", "patch")}
HEARTBEAT_READ = {("leases.coordination.k8s.io", HEARTBEAT, v) for v in ("get", "list", "watch")}


@dataclass
class Identity:
    """Raw HTTPS calls as one bearer token: the status code is the verdict, nothing retries or hides it."""

    cluster: Cluster
    token: str

    def call(self, method: str, path: str, query: dict[str, str] | None = None,
             body: dict[str, Any] | None = None, content_type: str = "application/json") -> tuple[int, Any]:
        """(status, body or a watch's first event). 429, the server asking to retry (a CRD's storage still
        initializing just after it was installed), is retried, as clients do; any other code is the answer."""
        answer: list[tuple[int, Any]] = []

        def answered() -> bool:
            answer[:] = [self._once(method, path, query, body, content_type)]
            return answer[0][0] != 429

        wait_until(answered, 30, f"{method} {path} past 429", interval=0.5)
        return answer[0]

    def _once(self, method: str, path: str, query: dict[str, str] | None, body: dict[str, Any] | None,
              content_type: str) -> tuple[int, Any]:
        url = self.cluster.url + path + (f"?{urllib.parse.urlencode(query)}" if query else "")
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Content-Type": content_type, "Accept": "application/json"})
        context = ssl.create_default_context(cafile=str(self.cluster.ca_path))
        try:
            with urllib.request.urlopen(request, timeout=15, context=context) as response:
                # a watch: the first event is enough (the server sends ADDED for what exists at once)
                first = response.readline() if (query or {}).get("watch") else response.read()
                return response.status, json.loads(first) if first.strip() else None
        except urllib.error.HTTPError as exc:
            return exc.code, None


@pytest.fixture
def spoke(kube_cluster: Cluster, unique: str) -> Iterator[tuple[Cluster, str]]:
    """(cluster, release namespace) with CRDs, and two Leases there: the heartbeat and a leader-election
    one the hub must not see. Each test applies the chart's hub-access objects for its own release."""
    cluster = kube_cluster
    install_crds(cluster)
    namespace = f"hubacc-{unique}"
    cluster.kubectl("create", "namespace", namespace)
    cluster.apply(*({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": name, "namespace": namespace},
                     "spec": {"holderIdentity": "spoke-operator", "leaseDurationSeconds": 30}}
                    for name in (HEARTBEAT, f"{unique}-embedfleet-operator")))
    try:
        yield cluster, namespace
    finally:
        cluster.kubectl("delete", "namespace", namespace, "--wait=false")


def grant(cluster: Cluster, release: str, namespace: str, propagate_secrets: bool) -> tuple[Identity, str]:
    """The spoke chart's hub-access objects only (not the operator), applied; (the hub as a caller, its
    user name)."""
    sets = {"hubAccess.propagateSecrets": str(propagate_secrets).lower()}
    objects = [o for o in template([CI_VALUES["spoke"]], sets, release=release, namespace=namespace)
               if "hub" in o["metadata"]["name"] and o["kind"] in
               ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]
    assert {o["kind"] for o in objects} == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                                            "RoleBinding"}
    cluster.apply(*objects)
    account = f"{release}-embedfleet-hub"
    return Identity(cluster, cluster.token_for(namespace, account)), f"system:serviceaccount:{namespace}:{account}"


def ungrant(cluster: Cluster, release: str) -> None:
    for kind in ("clusterrolebinding", "clusterrole"):
        for suffix in ("hub-access", "hub-access-propagate"):
            cluster.kubectl("delete", kind, f"{release}-embedfleet-{suffix}", "--ignore-not-found")


@pytest.mark.parametrize("propagate_secrets", [False, True], ids=["no-secrets", "propagate-secrets"])
def test_the_hub_holds_exactly_what_its_loop_calls(spoke: tuple[Cluster, str], unique: str,
                                                   propagate_secrets: bool) -> None:
    cluster, namespace = spoke
    release = f"ha{unique}{int(propagate_secrets)}"
    try:
        _, user = grant(cluster, release, namespace, propagate_secrets)
        cluster_wide = COPIES | NAMESPACES | (SECRETS if propagate_secrets else set())
        assert rights(cluster, user, namespace) == cluster_wide | HEARTBEAT_READ
        assert rights(cluster, user, "default") == cluster_wide  # the Lease rule is the release namespace's only
    finally:
        ungrant(cluster, release)


def test_the_heartbeat_is_watched_by_name_and_nothing_else_is_read(spoke: tuple[Cluster, str], unique: str) -> None:
    cluster, namespace = spoke
    release = f"hw{unique}"
    try:
        hub, _ = grant(cluster, release, namespace, propagate_secrets=False)
        leases = LEASES.format(ns=namespace)
        by_name = {"fieldSelector": f"metadata.name={HEARTBEAT}"}

        assert hub.call("GET", f"{leases}/{HEARTBEAT}")[0] == 200
        status, listed = hub.call("GET", leases, by_name)
        assert status == 200 and [i["metadata"]["name"] for i in listed["items"]] == [HEARTBEAT]
        status, event = hub.call("GET", leases, {**by_name, "watch": "true", "timeoutSeconds": "5"})
        assert status == 200 and event["type"] == "ADDED" and event["object"]["metadata"]["name"] == HEARTBEAT
        rv = listed["metadata"]["resourceVersion"]  # the informer's path: list, then watch from its version
        status, _ = hub.call("GET", leases, {**by_name, "watch": "true", "resourceVersion": rv,
                                             "allowWatchBookmarks": "true", "timeoutSeconds": "1"})
        assert status == 200

        # Without the selector, or selecting the leader-election Lease: refused, list and watch alike.
        other = {"fieldSelector": f"metadata.name={unique}-embedfleet-operator"}
        for query in ({}, other, {"watch": "true", "timeoutSeconds": "1"}, {**other, "watch": "true"},
                      {"fieldSelector": f"metadata.name!={HEARTBEAT}"}):
            assert hub.call("GET", leases, query)[0] == 403, query
        assert hub.call("GET", f"{leases}/{unique}-embedfleet-operator")[0] == 403
        # Reads only: the heartbeat is the spoke's to write.
        assert hub.call("PATCH", f"{leases}/{HEARTBEAT}", body={"metadata": {"labels": {"x": "y"}}},
                        content_type="application/merge-patch+json")[0] == 403

        # Its copies: an informer over every namespace (list, then watch).
        status, copies = hub.call("GET", EDS, {"labelSelector": "embedfleet.dev/hub-managed"})
        assert status == 200
        status, _ = hub.call("GET", EDS, {"labelSelector": "embedfleet.dev/hub-managed", "watch": "true",
                                          "resourceVersion": copies["metadata"]["resourceVersion"],
                                          "timeoutSeconds": "1"})
        assert status == 200

        # A copy's namespace: read and created when missing; never listed, changed or deleted.
        made = f"{unique}-made-by-hub"
        assert hub.call("GET", f"/api/v1/namespaces/{made}")[0] == 404
        assert hub.call("POST", "/api/v1/namespaces", body={"apiVersion": "v1", "kind": "Namespace",
                                                            "metadata": {"name": made}})[0] == 201
        assert hub.call("GET", f"/api/v1/namespaces/{made}")[0] == 200
        assert hub.call("GET", "/api/v1/namespaces")[0] == 403
        assert hub.call("DELETE", f"/api/v1/namespaces/{made}")[0] == 403
        cluster.kubectl("delete", "namespace", made, "--wait=false")

        # No Secret right at all unless hubAccess.propagateSecrets.
        assert hub.call("GET", f"/api/v1/namespaces/{namespace}/secrets/any")[0] == 403
        assert hub.call("POST", f"/api/v1/namespaces/{namespace}/secrets",
                        body={"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "k"}})[0] == 403
    finally:
        ungrant(cluster, release)


def test_propagated_secrets_are_copied_never_listed_or_deleted(spoke: tuple[Cluster, str], unique: str) -> None:
    cluster, namespace = spoke
    release = f"hs{unique}"
    try:
        hub, _ = grant(cluster, release, namespace, propagate_secrets=True)
        secrets = f"/api/v1/namespaces/{namespace}/secrets"
        key = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "api-key"}, "stringData": {"key": "k1"}}
        assert hub.call("GET", f"{secrets}/api-key")[0] == 404
        assert hub.call("POST", secrets, body=key)[0] == 201
        assert hub.call("PATCH", f"{secrets}/api-key", body={"stringData": {"key": "k2"}},
                        content_type="application/merge-patch+json")[0] == 200
        assert hub.call("GET", f"{secrets}/api-key")[0] == 200
        assert hub.call("GET", secrets)[0] == 403
        assert hub.call("DELETE", f"{secrets}/api-key")[0] == 403
    finally:
        ungrant(cluster, release)
