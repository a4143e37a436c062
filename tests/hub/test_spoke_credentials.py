"""Spoke credentials (operator/hub/credentials.py): the allow-lists refuse before anything runs, a real exec
plugin process is run as client-go runs it and its failures are named, tokens are renewed before they expire,
and a failed renewal keeps a still-valid token."""

from __future__ import annotations

import base64
import json
import math
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.hub import credentials as cr
from embedfleet.operator.hub.errors import credential_problem
from tests.hub.plugin import calls, exec_kubeconfig, write_plugin

CA = base64.b64encode(b"not a real CA").decode()


def config(user: dict, cluster: dict | None = None) -> dict:
    return {"apiVersion": "v1", "kind": "Config", "current-context": "c",
            "clusters": [{"name": "k", "cluster": {"server": "https://198.18.0.1:6443", **(cluster or {})}}],
            "users": [{"name": "u", "user": user}],
            "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}


@pytest.fixture
def plugin(tmp_path: Path) -> tuple[Path, Path]:
    return write_plugin(tmp_path / "cloud-auth"), tmp_path / "calls.log"


# ------------------------------------------------------------------ allow-lists


def test_an_exec_plugin_not_allowed_is_refused_and_never_run(plugin: tuple[Path, Path]) -> None:
    script, log = plugin
    doc = exec_kubeconfig("https://198.18.0.1:6443", CA, str(script), {"PLUGIN_LOG": str(log)})
    with pytest.raises(cr.CredentialRefused) as refused:
        cr.spoke_client(yaml.safe_dump(doc).encode(), cr.CredentialPolicy(), timeout=(1, 1))
    assert refused.value.reason == "ExecPluginNotAllowed"
    assert str(script) in str(refused.value) and "--spoke-exec-plugin" in str(refused.value)
    assert credential_problem(refused.value) == "ExecPluginNotAllowed"
    assert calls(log) == 0, "a refused plugin must not run"


@pytest.mark.parametrize("where,key", [("user", "tokenFile"), ("user", "client-certificate"),
                                       ("user", "client-key"), ("cluster", "certificate-authority")])
@pytest.mark.parametrize("path", ["/var/run/secrets/kubernetes.io/serviceaccount/token",
                                  "/etc/spoke/../../var/run/secrets/kubernetes.io/serviceaccount/token",
                                  "relative/token"])
def test_a_file_outside_the_credential_dirs_is_refused(where: str, key: str, path: str) -> None:
    doc = config({key: path, "token": "t"} if where == "user" else {"token": "t"},
                 {key: path} if where == "cluster" else None)
    with pytest.raises(cr.CredentialRefused) as refused:
        cr.check(doc, cr.CredentialPolicy(credential_dirs=("/etc/spoke",)))
    assert refused.value.reason == "CredentialFileNotAllowed" and key in str(refused.value)


def test_files_under_a_credential_dir_and_static_tokens_pass() -> None:
    policy = cr.CredentialPolicy(credential_dirs=("/etc/spoke",))
    assert cr.check(config({"tokenFile": "/etc/spoke/eu/token"}), policy).user_name == "u"
    assert cr.check(config({"token": "static"}), cr.CredentialPolicy()).user == {"token": "static"}


@pytest.mark.parametrize("user,reason", [
    ({"auth-provider": {"name": "oidc"}}, "AuthProviderUnsupported"),
    ({"exec": {"command": "aws"}}, "InvalidKubeconfig"),  # no apiVersion
    ({"exec": {"command": "aws", "apiVersion": "client.authentication.k8s.io/v1", "interactiveMode": "Always"}},
     "InvalidKubeconfig"),
])
def test_unsupported_ways_of_authenticating_are_named(user: dict, reason: str) -> None:
    with pytest.raises(cr.CredentialRefused) as refused:
        cr.check(config(user), cr.CredentialPolicy(exec_plugins=frozenset({"aws"})))
    assert refused.value.reason == reason


@pytest.mark.parametrize("doc", ["just a string", {"users": []},
                                 {"current-context": "x", "contexts": [{"name": "y", "context": {}}]}])
def test_a_kubeconfig_without_a_usable_context_is_invalid(doc: object) -> None:
    with pytest.raises(cr.CredentialRefused) as refused:
        cr.check(doc, cr.CredentialPolicy())
    assert refused.value.reason == "InvalidKubeconfig"


def test_the_policy_reads_the_environment() -> None:
    policy = cr.CredentialPolicy.from_env({cr.ENV_EXEC_PLUGINS: "aws, kubelogin,", cr.ENV_CREDENTIAL_DIRS: "/a,/b"})
    assert policy == cr.CredentialPolicy(frozenset({"aws", "kubelogin"}), ("/a", "/b"))


# ------------------------------------------------------------------ the plugin process


def test_the_plugin_is_run_as_client_go_runs_it(plugin: tuple[Path, Path]) -> None:
    script, log = plugin
    doc = exec_kubeconfig("https://198.18.0.1:6443", CA, str(script),
                          {"PLUGIN_LOG": str(log), "PLUGIN_TOKEN": "abc", "PLUGIN_LIFETIME": "600"},
                          provideClusterInfo=True, args=["--cluster", "eu"])
    kube, source = cr.spoke_client(yaml.safe_dump(doc).encode(),
                                   cr.CredentialPolicy(exec_plugins=frozenset({str(script)})), timeout=(1, 1))
    assert source is not None and source.fetches == 1 and calls(log) == 1
    config = kube.client.configuration
    assert config.get_api_key_with_prefix("BearerToken") == "Bearer abc"
    assert config.host == "https://198.18.0.1:6443"
    info = json.loads(log.read_text().splitlines()[0])
    assert info["kind"] == "ExecCredential" and info["spec"]["interactive"] is False
    assert info["spec"]["cluster"]["server"] == "https://198.18.0.1:6443"
    assert info["spec"]["cluster"]["certificate-authority-data"] == CA
    config.get_api_key_with_prefix("BearerToken")
    assert calls(log) == 1, "a token 600 s from expiry is not fetched again"


@pytest.mark.parametrize("env,says", [
    ({"PLUGIN_MODE": "fail"}, "exited 3: login expired: run the cloud CLI's login again"),
    ({"PLUGIN_MODE": "garbage"}, "unusable answer"),
    ({"PLUGIN_API_VERSION": "client.authentication.k8s.io/v1beta1"}, "unusable answer"),
])
def test_a_failing_plugin_is_named_with_its_first_error_line(plugin: tuple[Path, Path], env: dict, says: str) -> None:
    script, log = plugin
    doc = exec_kubeconfig("https://198.18.0.1:6443", CA, str(script), {"PLUGIN_LOG": str(log), **env})
    with pytest.raises(cr.CredentialRefused) as refused:
        cr.spoke_client(yaml.safe_dump(doc).encode(),
                        cr.CredentialPolicy(exec_plugins=frozenset({str(script)})), timeout=(1, 1))
    assert refused.value.reason == "ExecPluginFailed" and says in str(refused.value)
    assert "second line" not in str(refused.value)


def test_a_missing_plugin_is_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    doc = exec_kubeconfig("https://198.18.0.1:6443", CA, missing, {})
    with pytest.raises(cr.CredentialRefused) as refused:
        cr.spoke_client(yaml.safe_dump(doc).encode(), cr.CredentialPolicy(exec_plugins=frozenset({missing})),
                        timeout=(1, 1))
    assert refused.value.reason == "ExecPluginFailed" and "not found" in str(refused.value)


def test_a_token_file_is_read_anew(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("first\n")
    doc = config({"tokenFile": str(tmp_path / "token")})
    clock = [1000.0]
    kube, source = cr.spoke_client(yaml.safe_dump(doc).encode(),
                                   cr.CredentialPolicy(credential_dirs=(str(tmp_path),)), timeout=(1, 1))
    assert source is not None
    source._clock = lambda: clock[0]  # the test's clock from here on
    source._renew_at = clock[0] + cr.FILE_REFRESH_S
    key = kube.client.configuration.get_api_key_with_prefix
    assert key("BearerToken") == "Bearer first"
    (tmp_path / "token").write_text("second\n")  # kubelet rotated the projected token
    assert key("BearerToken") == "Bearer first"
    clock[0] += cr.FILE_REFRESH_S
    assert key("BearerToken") == "Bearer second"


# ------------------------------------------------------------------ renewal


@given(fetched=st.floats(0, 1e9), lifetime=st.floats(0, 1e6))
def test_renewal_comes_before_expiry_and_after_the_fetch(fetched: float, lifetime: float) -> None:
    expiry = fetched + lifetime
    at = cr.renew_at(fetched, expiry)
    assert fetched <= at <= expiry
    assert expiry - at <= cr.MAX_MARGIN_S + 1e-6
    if lifetime > 0:
        # Strictly before expiry whenever a third of the lifetime is representable at this magnitude.
        assert at < expiry or (expiry - fetched) / 3 < math.ulp(expiry)
    assert cr.renew_at(fetched, None) == fetched + cr.NO_EXPIRY_REFRESH_S


class Fetcher:
    def __init__(self, clock: list[float], lifetime: float) -> None:
        self.clock, self.lifetime, self.n, self.fail = clock, lifetime, 0, False

    def __call__(self) -> tuple[str, datetime | None]:
        self.n += 1
        if self.fail:
            raise cr.CredentialRefused("ExecPluginFailed", "down")
        return f"t{self.n}", datetime.fromtimestamp(self.clock[0] + self.lifetime, UTC)


def test_a_token_is_renewed_a_third_of_its_life_before_expiry() -> None:
    clock = [0.0]
    fetch = Fetcher(clock, lifetime=900.0)
    source = cr.TokenSource(fetch, clock=lambda: clock[0])
    assert source.token() == "t1"
    clock[0] = 599.0
    assert source.token() == "t1"
    clock[0] = 600.0  # 900 - min(300, 900 / 3)
    assert source.token() == "t2"


def test_a_failed_renewal_keeps_a_valid_token_then_fails_once_it_expires() -> None:
    clock = [0.0]
    fetch = Fetcher(clock, lifetime=30.0)
    source = cr.TokenSource(fetch, clock=lambda: clock[0])
    assert source.token() == "t1"
    fetch.fail = True
    clock[0] = 25.0
    assert source.token() == "t1", "still valid: kept"
    tries = fetch.n
    clock[0] = 26.0
    assert source.token() == "t1" and fetch.n == tries, "no new try before RETRY_S"
    clock[0] = 31.0
    with pytest.raises(cr.CredentialRefused):
        source.token()
    fetch.fail = False
    clock[0] = 31.0 + cr.RETRY_S
    assert source.token().startswith("t")


def test_concurrent_callers_share_one_renewal() -> None:
    clock = [0.0]
    gate = threading.Event()
    fetch = Fetcher(clock, lifetime=3600.0)

    def slow() -> tuple[str, datetime | None]:
        gate.wait(5)
        return fetch()

    source = cr.TokenSource(slow, clock=lambda: clock[0])
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(source.token())) for _ in range(8)]
    for t in threads:
        t.start()
    gate.set()
    for t in threads:
        t.join(10)
    assert got == ["t1"] * 8 and fetch.n == 1


def test_expiry_timestamps_parse_as_client_go_writes_them() -> None:
    assert cr._rfc3339("2026-11-26T19:00:00Z") == datetime(2026, 11, 26, 19, tzinfo=UTC)
    assert cr._rfc3339("2026-11-26T19:00:00+01:00") == datetime(2026, 11, 26, 18, tzinfo=UTC) + timedelta(0)
