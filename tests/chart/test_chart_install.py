"""`helm install`, `upgrade` and `uninstall` of the chart on a real API server, for every role with its ci/
values: what a release creates exists (and rolls out on kwok nodes), an upgrade changes what it should,
uninstall leaves nothing behind but what the README says it keeps (the CRDs, namespaces the chart
created), and CRD upgrades work the way the README says."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.chart.helm import CHART, CI_VALUES, CRD_FILES, ROLES, fullname, live, release_manifest, value_args
from tests.kube.controlplane import ROOT, Cluster, ControlPlane

CRD_NAMES = sorted(yaml.safe_load(p.read_text())["metadata"]["name"] for p in CRD_FILES)
KEEP = "helm.sh/resource-policy"


def install(cluster: Cluster, release: str, namespace: str, role: str, sets: dict[str, str] | None = None,
            *, wait: bool = True, check: bool = True, action: str = "install") -> Any:
    args = [action, release, str(CHART), "-n", namespace, *value_args([CI_VALUES[role]], sets)]
    if action == "install":
        args.append("--create-namespace")
    args += ["--wait=watcher", "--timeout=120s"] if wait else ["--wait=hookOnly"]
    return cluster.helm(*args, check=check)


def watched_sets(names: list[str]) -> dict[str, str]:
    return {f"watchNamespaces[{i}]": name for i, name in enumerate(names)}


def crds_established(cluster: Cluster) -> list[str]:
    found = []
    for name in CRD_NAMES:
        crd = cluster.get_json("crd", name) or {}
        if any(c["type"] == "Established" and c["status"] == "True"
               for c in (crd.get("status") or {}).get("conditions") or []):
            found.append(name)
    return found


@pytest.mark.parametrize("role", ROLES)
def test_install_upgrade_uninstall(kube_cluster: Cluster, unique: str, role: str) -> None:
    cluster = kube_cluster
    release, namespace = f"inst-{unique}", f"inst-{unique}"
    # The spoke's ci values watch namespaces that do not exist: the install creates them (unique names here).
    watched = [f"emb-{unique}", f"search-{unique}"] if role == "spoke" else []
    sets = watched_sets(watched)
    for ns in watched:
        assert cluster.get_json("namespace", ns) is None

    install(cluster, release, namespace, role, sets)
    manifest = release_manifest(cluster, release, namespace)
    missing = [f"{o['kind']} {o['metadata']['name']}" for o in manifest if live(cluster, o) is None]
    assert missing == []
    assert crds_established(cluster) == CRD_NAMES
    deployment = cluster.get_json("deployment", fullname(release), "-n", namespace)
    assert deployment["status"].get("readyReplicas") == deployment["spec"]["replicas"]  # rolled out (kwok)
    for ns in watched:
        created = cluster.get_json("namespace", ns)
        assert created["metadata"]["annotations"][KEEP] == "keep"
        assert cluster.get_json("rolebinding", fullname(release), "-n", ns)["roleRef"]["name"] == \
            f"{fullname(release)}-namespaced"

    # An upgrade re-renders the namespaces it created (they stay in the release) and changes the operator.
    install(cluster, release, namespace, role, {**sets, "logLevel": "verbose"}, action="upgrade")
    status = cluster.helm("status", release, "-n", namespace, "-o", "json").stdout
    assert '"version":2' in status.replace(" ", "")
    args = cluster.get_json("deployment", fullname(release), "-n", namespace)["spec"]["template"]["spec"][
        "containers"][0]["args"]
    assert "--verbose" in args
    upgraded = release_manifest(cluster, release, namespace)
    assert sorted(o["metadata"]["name"] for o in upgraded if o["kind"] == "Namespace") == sorted(watched)

    cluster.helm("uninstall", release, "-n", namespace, "--wait", "--timeout=120s")
    left = [f"{o['kind']} {o['metadata']['name']}" for o in upgraded
            if o["kind"] != "Namespace" and live(cluster, o) is not None]
    assert left == []
    # Kept by design: the CRDs (helm never deletes crds/; deleting them deletes every custom resource) and
    # the namespaces the release created (helm.sh/resource-policy: keep).
    assert crds_established(cluster) == CRD_NAMES
    for ns in watched:
        assert cluster.get_json("namespace", ns) is not None
    cluster.kubectl("delete", "namespace", namespace, *watched, "--wait=false")


def test_watch_namespaces_are_created_never_taken_over(kube_cluster: Cluster, unique: str) -> None:
    cluster = kube_cluster
    release, namespace = f"wns-{unique}", f"wns-{unique}"
    existing, new = f"own-{unique}", f"new-{unique}"
    cluster.kubectl("create", "namespace", existing)
    sets = watched_sets([existing, new])

    install(cluster, release, namespace, "spoke", sets, wait=False)
    manifest = release_manifest(cluster, release, namespace)
    assert [o["metadata"]["name"] for o in manifest if o["kind"] == "Namespace"] == [new]
    assert "meta.helm.sh/release-name" not in (cluster.get_json("namespace", existing)["metadata"].get(
        "annotations") or {})
    for ns in (existing, new):
        assert cluster.get_json("rolebinding", fullname(release), "-n", ns) is not None

    cluster.helm("uninstall", release, "-n", namespace, "--wait", "--timeout=60s")
    for ns in (existing, new):
        assert cluster.get_json("namespace", ns) is not None
        assert cluster.get_json("rolebinding", fullname(release), "-n", ns) is None

    # Installed again under the same name, the release takes back the namespace it created before.
    install(cluster, release, namespace, "spoke", sets, wait=False)
    manifest = release_manifest(cluster, release, namespace)
    assert [o["metadata"]["name"] for o in manifest if o["kind"] == "Namespace"] == [new]
    cluster.helm("uninstall", release, "-n", namespace, "--wait", "--timeout=60s")

    # Another release watching the same namespaces never claims them.
    other = f"wno-{unique}"
    install(cluster, other, namespace, "spoke", sets, wait=False)
    assert not [o for o in release_manifest(cluster, other, namespace) if o["kind"] == "Namespace"]
    cluster.helm("uninstall", other, "-n", namespace, "--wait", "--timeout=60s")

    # Not asked to create them: a missing namespace fails the install, as the README says.
    missing = f"missing-{unique}"
    done = install(cluster, f"wnm-{unique}", namespace, "spoke",
                   {**watched_sets([missing]), "createWatchNamespaces": "false"}, wait=False, check=False)
    assert done.returncode != 0 and f'namespaces "{missing}" not found' in done.stderr
    cluster.helm("uninstall", f"wnm-{unique}", "-n", namespace, check=False)
    cluster.kubectl("delete", "namespace", namespace, existing, new, "--wait=false")


def test_two_releases_side_by_side(kube_cluster: Cluster, unique: str) -> None:
    """Two releases in one namespace (a hub and a standalone operator, say) and a third elsewhere install
    together; uninstalling one leaves the others' objects."""
    cluster = kube_cluster
    shared, other = f"pair-{unique}", f"pair2-{unique}"
    releases = [(f"a-{unique}", shared, "standalone"), (f"b-{unique}", shared, "hub"),
                (f"c-{unique}", other, "standalone")]
    for release, namespace, role in releases:
        install(cluster, release, namespace, role, wait=False)
    manifests = {r: release_manifest(cluster, r, ns) for r, ns, _ in releases}
    cluster.helm("uninstall", releases[0][0], "-n", shared, "--wait", "--timeout=60s")
    for release, _, _ in releases[1:]:
        assert [o for o in manifests[release] if live(cluster, o) is None] == []
        cluster.helm("uninstall", release, "-n", shared if release.startswith("b-") else other)
    cluster.kubectl("delete", "namespace", shared, other, "--wait=false")


@pytest.mark.parametrize("role", ROLES)
def test_every_ci_values_file_installs_on_a_bare_cluster(fresh_plane: ControlPlane, role: str) -> None:
    """No CRDs, no namespaces: `helm install` with the role's ci/ file is all it takes."""
    cluster = fresh_plane.add_cluster(f"bare-{role}", nodes=None, controllers=False)
    assert crds_established(cluster) == []
    install(cluster, "embedfleet", "embedfleet-system", role, wait=False)
    assert crds_established(cluster) == CRD_NAMES
    manifest = release_manifest(cluster, "embedfleet", "embedfleet-system")
    assert [o for o in manifest if live(cluster, o) is None] == []


def readme_crd_upgrade_command() -> list[str]:
    """The command the chart README gives for CRD upgrades (run from the repository root)."""
    text = (CHART / "README.md").read_text()
    (line,) = {m.group(0).strip() for m in re.finditer(r"^kubectl apply --server-side .*crds/?$", text, re.M)}
    return shlex.split(line)


def test_crd_upgrades_work_as_the_readme_says(fresh_plane: ControlPlane, tmp_path: Path) -> None:
    """helm installs crds/ on the first install only: an upgrade leaves an older CRD as it was, and the
    README's `kubectl apply --server-side` brings it up to date."""
    cluster = fresh_plane.add_cluster("crds", nodes=None, controllers=False)
    old_chart = tmp_path / "embedfleet"
    shutil.copytree(CHART, old_chart)
    crd_path = old_chart / "crds" / "embeddingdeployments.embedfleet.dev.yaml"
    crd = yaml.safe_load(crd_path.read_text())
    for version in crd["spec"]["versions"]:
        del version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["placement"]
    crd_path.write_text(yaml.safe_dump(crd))
    cluster.helm("install", "embedfleet", str(old_chart), "-n", "embedfleet-system", "--create-namespace")
    cluster.kubectl("create", "namespace", "apps")
    example = yaml.safe_load((ROOT / "examples" / "embedding-hf.yaml").read_text())
    example["metadata"]["namespace"] = "apps"
    assert "placement" in example["spec"]

    def apply_example() -> Any:
        return cluster.kubectl("apply", "--validate=strict", "-f", "-", input=yaml.safe_dump(example), check=False)

    refused = apply_example()
    assert refused.returncode != 0 and "placement" in refused.stderr

    cluster.helm("upgrade", "embedfleet", str(CHART), "-n", "embedfleet-system")
    assert apply_example().returncode != 0, "helm upgrade changed a CRD; the README says it never does"

    command = readme_crd_upgrade_command()
    assert command[0] == "kubectl" and (ROOT / command[-1]).is_dir(), command
    done = _run_from_root(cluster, command)
    assert done.returncode == 0, done.stderr
    accepted = apply_example()
    assert accepted.returncode == 0, accepted.stderr

    cluster.helm("uninstall", "embedfleet", "-n", "embedfleet-system")
    assert crds_established(cluster) == CRD_NAMES  # uninstall keeps CRDs (and so the custom resources)
    assert cluster.get_json("embeddingdeployment", example["metadata"]["name"], "-n", "apps") is not None


def _run_from_root(cluster: Cluster, command: list[str]) -> Any:
    """The README's command as a user runs it, in the repository root (its path is relative)."""
    argv = [str(cluster.bin / "kubectl"), f"--kubeconfig={cluster.kubeconfig}", *command[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    # A later release (another namespace) on CRDs kubectl now manages: helm's server-side apply of crds/
    # conflicts with kubectl's field manager, and the README's --skip-crds installs it.
    conflict = cluster.helm("install", "second", str(CHART), "-n", "second", "--create-namespace", check=False)
    assert conflict.returncode != 0 and "conflict" in conflict.stderr, conflict.stderr
    cluster.helm("install", "second", str(CHART), "-n", "second", "--create-namespace", "--skip-crds")
