"""A hub reaching its spoke through an exec credential plugin, on the real test control plane (a hub and one
spoke, two kube-apiservers on one etcd, the chart's operators as the chart's identities; tests/hub/fleet.py).

The plugin (tests/hub/plugin.py) plays a cloud's token command: it mints a bound ServiceAccount token of the
hub's identity on the spoke through the TokenRequest API and says it expires in a few seconds, so renewals
come within the test. The chart's ``hub.spokeCredentials.execPlugins`` allows it. Shown:

- the hub places on the spoke with the plugin's tokens, renews them before they expire without a restart
  (the spoke's audit log sees the hub's writes under more than one credential), and no call is refused;
- a plugin the chart does not list is refused before it runs: ``CredentialsValid=False``,
  ``ExecPluginNotAllowed``, and its log stays empty;
- a plugin that fails is ``ExecPluginFailed`` with the first line it wrote to stderr.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.hub.fleet import SYSTEM, Fleet, embedding, errors, hub_identity, hub_user, running_fleet
from tests.hub.plugin import calls, exec_kubeconfig, write_plugin
from tests.kube.controlplane import ADMIN_TOKEN, wait_until

REGIONS = {"eu": "eu-west-1"}
NS = "ml"
LIFETIME_S = 5  # the expiry the plugin states (its tokens really last 10 minutes)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("exec-plugin")


@pytest.fixture(scope="module")
def fleet(workdir: Path) -> Iterator[Fleet]:
    allowed = write_plugin(workdir / "cloud-auth")
    values = {"hub": {"hub.spokeCredentials.execPlugins[0]": str(allowed)}}
    with running_fleet(workdir, REGIONS, values=values, prepare=lambda f: f.namespace(NS)) as fleet:
        yield fleet


def _use(fleet: Fleet, command: Path, log: Path, **env: str) -> None:
    """The spoke's kubeconfig Secret on the hub: authenticate by running ``command``."""
    spoke = fleet.spokes["eu"]
    doc = exec_kubeconfig(spoke.url, base64.b64encode(spoke.ca_path.read_bytes()).decode(), str(command),
                          {"PLUGIN_LOG": str(log), "PLUGIN_SERVER": spoke.url, "PLUGIN_CA": str(spoke.ca_path),
                           "PLUGIN_ADMIN_TOKEN": ADMIN_TOKEN,
                           "PLUGIN_SERVICE_ACCOUNT": f"{SYSTEM}/{hub_identity('eu')}",
                           "PLUGIN_LIFETIME": str(LIFETIME_S), **env})
    fleet.hub.apply({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "eu-kubeconfig", "namespace": SYSTEM},
                     "data": {"kubeconfig": base64.b64encode(yaml.safe_dump(doc).encode()).decode()}})


def _credentials(fleet: Fleet) -> dict:
    fc = fleet.hub.get_json("fleetcluster", "eu") or {}
    return {c["type"]: c for c in (fc.get("status") or {}).get("conditions") or []}.get("CredentialsValid") or {}


def test_the_hub_places_with_plugin_tokens_renewed_before_expiry(fleet: Fleet, workdir: Path) -> None:
    log = workdir / "allowed.log"
    fleet.marks()
    _use(fleet, workdir / "cloud-auth", log)
    wait_until(lambda: calls(log) >= 1, 30, "the hub ran the allowed plugin")
    fleet.hub.apply(embedding("renewed", NS, replicas=1))
    fleet.wait_settled("renewed", NS, {"eu": 1})
    for replicas in (2, 1):  # writes spaced past the renewal point: each needs a token then
        time.sleep(LIFETIME_S)
        fleet.hub.apply(embedding("renewed", NS, replicas=replicas))
        fleet.wait_settled("renewed", NS, {"eu": replicas})
    assert calls(log) >= 3, f"the plugin ran {calls(log)} times: tokens were not renewed"
    assert _credentials(fleet).get("status") == "True", _credentials(fleet)
    mine = [e for e in fleet.spokes["eu"].audit() if e.user == hub_user("eu")]
    used = {e.credential for e in mine if e.is_write and e.resource == "embeddingdeployments"}
    assert len(used - {""}) >= 2, f"the hub's writes used one credential: {used}"
    assert errors(mine, hub_user("eu")) == []


def test_a_plugin_the_chart_does_not_list_never_runs(fleet: Fleet, workdir: Path) -> None:
    other = write_plugin(workdir / "other-auth")
    log = workdir / "other.log"
    _use(fleet, other, log)
    wait_until(lambda: _credentials(fleet).get("status") == "False", 30, "CredentialsValid=False")
    cond = _credentials(fleet)
    assert cond["reason"] == "ExecPluginNotAllowed" and str(other) in cond["message"], cond
    assert calls(log) == 0, "a plugin outside the allow-list ran"


def test_a_failing_plugin_is_reported_with_its_error(fleet: Fleet, workdir: Path) -> None:
    log = workdir / "failing.log"
    _use(fleet, workdir / "cloud-auth", log, PLUGIN_MODE="fail")
    wait_until(lambda: _credentials(fleet).get("reason") == "ExecPluginFailed", 30, "ExecPluginFailed")
    assert "login expired" in _credentials(fleet)["message"]
    assert fleet.copies("renewed", NS) == {"eu": 1}, "a credential problem fails nothing over"
    _use(fleet, workdir / "cloud-auth", workdir / "again.log")
    wait_until(lambda: _credentials(fleet).get("status") == "True", 30, "CredentialsValid=True again")
