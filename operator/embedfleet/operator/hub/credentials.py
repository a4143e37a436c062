"""How the hub authenticates to a spoke: the kubeconfig in the FleetCluster's Secret, checked against the
platform's allow-lists, with tokens that are short-lived and renewed before they expire.

Managed clusters authenticate with exec credential plugins (`aws eks get-token`, `gke-gcloud-auth-plugin`,
`kubelogin`): a command that prints an ``ExecCredential`` holding a token and its expiry. The ``kubernetes``
package can run them, but not in a way a hub can live with: it runs whatever command a kubeconfig names,
logs a failing plugin's error and carries on unauthenticated (the spoke then answers 401 and the cause is
lost), and reads a ``tokenFile`` once. So the hub takes the credential part of the kubeconfig itself:

- **Allow-lists.** A kubeconfig in a Secret must not make the hub run a program or read a file the platform
  did not choose: the exec command must be one of ``--spoke-exec-plugin`` (exactly as written in the
  kubeconfig), and every file the kubeconfig names (``tokenFile``, certificate files) must lie under one of
  ``--spoke-credential-dir``. Anything else is refused before anything runs, with a reason the FleetCluster
  shows (``CredentialsValid=False``).
- **Renewal before expiry.** A :class:`TokenSource` holds the token and fetches a new one a third of its
  lifetime (at most five minutes) before it expires; a token without an expiry is fetched again every
  fifteen minutes, a token file re-read every minute (kubelet rotates projected tokens at 80% of their
  life). A failed renewal keeps the current token while it is valid and tries again shortly; only an
  expired token without a successor fails the spoke's calls, as a credential problem.
- The rest of the kubeconfig (server, CA, TLS) is still read by the ``kubernetes`` package.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import PurePosixPath
from typing import Any

import kubernetes
import yaml

from embedfleet.operator.kube import Kube, user_agent

log = logging.getLogger(__name__)

ENV_EXEC_PLUGINS = "EMBEDFLEET_HUB_EXEC_PLUGINS"
ENV_CREDENTIAL_DIRS = "EMBEDFLEET_HUB_CREDENTIAL_DIRS"
EXEC_API_VERSIONS = ("client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1")
EXEC_TIMEOUT_S = 30.0
MAX_MARGIN_S = 300.0  # renew at most this long before expiry
NO_EXPIRY_REFRESH_S = 900.0  # a plugin token without an expiry is fetched again after this long
FILE_REFRESH_S = 60.0  # a token file is re-read this often
RETRY_S = 5.0  # after a failed renewal, the next try waits this long
USER_FILE_KEYS = ("tokenFile", "client-certificate", "client-key")
CLUSTER_FILE_KEYS = ("certificate-authority",)

Fetch = Callable[[], tuple[str, "datetime | None"]]


class CredentialRefused(ValueError):
    """A spoke credential the hub will not use or could not get; ``reason`` is the FleetCluster condition's
    reason word. A ValueError, so the hub's existing handling of a spoke's errors applies."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class CredentialPolicy:
    """What a spoke's kubeconfig may make the hub do: run these exec plugin commands, read files under these
    directories. Empty (the default): neither."""

    exec_plugins: frozenset[str] = frozenset()
    credential_dirs: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> CredentialPolicy:
        def items(name: str) -> list[str]:
            return [part.strip() for part in environ.get(name, "").split(",") if part.strip()]

        return cls(frozenset(items(ENV_EXEC_PLUGINS)), tuple(items(ENV_CREDENTIAL_DIRS)))

    def allows_file(self, path: str) -> bool:
        """An absolute path that stays under an allowed directory once ``..`` is resolved (the name as
        written: a symlink inside an allowed directory is the platform's own choice)."""
        if not os.path.isabs(path):
            return False
        norm = PurePosixPath(os.path.normpath(path))
        return any(norm.is_relative_to(os.path.normpath(root)) for root in self.credential_dirs
                   if os.path.isabs(root))


@dataclass(frozen=True)
class Selected:
    """The current context's cluster and user entries of a kubeconfig."""

    cluster: dict[str, Any]
    user: dict[str, Any]
    user_name: str


def _named(doc: Mapping[str, Any], key: str, name: str, inner: str) -> dict[str, Any]:
    for item in doc.get(key) or []:
        if isinstance(item, Mapping) and item.get("name") == name and isinstance(item.get(inner), Mapping):
            return dict(item[inner])
    raise CredentialRefused("InvalidKubeconfig", f"kubeconfig: no {inner} named {name!r}")


def select(doc: Any) -> Selected:
    """The entries the kubeconfig's current context uses (the only ones the hub reads)."""
    if not isinstance(doc, Mapping):
        raise CredentialRefused("InvalidKubeconfig", "kubeconfig: not a YAML mapping")
    current = doc.get("current-context")
    context = _named(doc, "contexts", str(current), "context") if current else None
    if context is None:
        raise CredentialRefused("InvalidKubeconfig", "kubeconfig: no current-context")
    user_name = str(context.get("user"))
    return Selected(_named(doc, "clusters", str(context.get("cluster")), "cluster"),
                    _named(doc, "users", user_name, "user"), user_name)


def check(doc: Any, policy: CredentialPolicy) -> Selected:
    """Refuse (CredentialRefused) a kubeconfig that names a command or a file outside ``policy``, or a way
    of authenticating the hub does not support; nothing is run or read here."""
    selected = select(doc)
    for where, entry, keys in (("user", selected.user, USER_FILE_KEYS),
                               ("cluster", selected.cluster, CLUSTER_FILE_KEYS)):
        for key in keys:
            path = entry.get(key)
            if path is not None and not policy.allows_file(str(path)):
                raise CredentialRefused(
                    "CredentialFileNotAllowed",
                    f"kubeconfig {where} {key} {path!r} is outside the hub's credential directories "
                    f"({', '.join(policy.credential_dirs) or 'none'}: --spoke-credential-dir)")
    if "auth-provider" in selected.user:
        raise CredentialRefused("AuthProviderUnsupported",
                                "kubeconfig user: auth-provider is not supported; use an exec credential plugin")
    exec_ = selected.user.get("exec")
    if exec_ is not None:
        if not isinstance(exec_, Mapping) or not isinstance(exec_.get("command"), str):
            raise CredentialRefused("InvalidKubeconfig", "kubeconfig user exec: a command is required")
        if exec_["command"] not in policy.exec_plugins:
            raise CredentialRefused(
                "ExecPluginNotAllowed",
                f"kubeconfig exec plugin {exec_['command']!r} is not one the hub may run "
                f"({', '.join(sorted(policy.exec_plugins)) or 'none'}: --spoke-exec-plugin)")
        if exec_.get("apiVersion") not in EXEC_API_VERSIONS:
            raise CredentialRefused("InvalidKubeconfig",
                                    f"kubeconfig exec apiVersion must be one of {', '.join(EXEC_API_VERSIONS)}")
        if exec_.get("interactiveMode") == "Always":
            raise CredentialRefused("InvalidKubeconfig",
                                    "kubeconfig exec interactiveMode Always: the hub has no terminal")
    return selected


def renew_at(fetched: float, expiry: float | None, no_expiry: float = NO_EXPIRY_REFRESH_S) -> float:
    """When a token fetched at ``fetched`` (seconds) and expiring at ``expiry`` should be replaced: a third
    of its lifetime before it expires, at most MAX_MARGIN_S before; ``no_expiry`` after fetching when it
    states none."""
    if expiry is None:
        return fetched + no_expiry
    lifetime = max(0.0, expiry - fetched)
    return expiry - min(MAX_MARGIN_S, lifetime / 3)


class TokenSource:
    """A bearer token renewed before it expires; thread-safe (the hub's informer and writer threads all ask
    it before each request), and at most one renewal runs at a time."""

    def __init__(self, fetch: Fetch, no_expiry: float = NO_EXPIRY_REFRESH_S,
                 clock: Callable[[], float] = time.time) -> None:
        self._fetch = fetch
        self._no_expiry = no_expiry
        self._clock = clock
        self._lock = threading.Lock()
        self._token: str | None = None
        self._expiry: float | None = None
        self._renew_at = 0.0
        self._retry_at = 0.0
        self._error: CredentialRefused | None = None
        self.fetches = 0

    def token(self) -> str:
        with self._lock:
            now = self._clock()
            if self._token is not None and now < self._renew_at:
                return self._token
            valid = self._token is not None and (self._expiry is None or now < self._expiry)
            if now < self._retry_at and self._error is not None:
                if valid:
                    return self._token  # type: ignore[return-value]
                raise self._error
            try:
                self.fetches += 1
                token, expiry = self._fetch()
            except CredentialRefused as exc:
                self._error, self._retry_at = exc, now + RETRY_S
                if valid:
                    log.warning("spoke credential: renewal failed, the current token is kept until it expires: %s",
                                exc)
                    return self._token  # type: ignore[return-value]
                raise
            self._token, self._error, self._retry_at = token, None, 0.0
            self._expiry = expiry.timestamp() if expiry is not None else None
            self._renew_at = renew_at(now, self._expiry, self._no_expiry)
            return token


def _rfc3339(value: str) -> datetime:
    parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def exec_fetch(exec_: Mapping[str, Any], cluster: Mapping[str, Any], timeout: float = EXEC_TIMEOUT_S) -> Fetch:
    """Run the exec plugin as kubectl does (client-go's credential protocol: ``KUBERNETES_EXEC_INFO`` in its
    environment, an ``ExecCredential`` on stdout), without a terminal; a failure is a CredentialRefused
    naming the plugin and the first line of what it wrote to stderr (never its output: that holds tokens)."""
    command = str(exec_["command"])
    api_version = str(exec_["apiVersion"])
    argv = [command, *(str(a) for a in exec_.get("args") or [])]
    env = dict(os.environ)
    for item in exec_.get("env") or []:
        if isinstance(item, Mapping) and "name" in item:
            env[str(item["name"])] = str(item.get("value", ""))
    spec: dict[str, Any] = {"interactive": False}
    if exec_.get("provideClusterInfo"):
        spec["cluster"] = {k: v for k, v in {
            "server": cluster.get("server"), "tls-server-name": cluster.get("tls-server-name"),
            "insecure-skip-tls-verify": cluster.get("insecure-skip-tls-verify"),
            "certificate-authority-data": cluster.get("certificate-authority-data"),
            "proxy-url": cluster.get("proxy-url")}.items() if v is not None}
    env["KUBERNETES_EXEC_INFO"] = json.dumps({"apiVersion": api_version, "kind": "ExecCredential", "spec": spec})

    def fetch() -> tuple[str, datetime | None]:
        try:
            done = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        except FileNotFoundError:
            raise CredentialRefused("ExecPluginFailed", f"exec plugin {command!r}: not found") from None
        except subprocess.TimeoutExpired:
            raise CredentialRefused("ExecPluginFailed", f"exec plugin {command!r}: no answer in {timeout:g} s") \
                from None
        except OSError as exc:
            raise CredentialRefused("ExecPluginFailed", f"exec plugin {command!r}: {exc.strerror}") from None
        if done.returncode != 0:
            first = next((line.strip() for line in done.stderr.splitlines() if line.strip()), "")
            raise CredentialRefused("ExecPluginFailed",
                                    f"exec plugin {command!r} exited {done.returncode}: {first[:200]}".rstrip(": "))
        try:
            answer = json.loads(done.stdout)
            status = answer["status"]
            if answer.get("apiVersion") != api_version or answer.get("kind") != "ExecCredential":
                raise ValueError(f"an ExecCredential of {api_version} was expected")
            token = status.get("token")
            if not isinstance(token, str) or not token:
                raise ValueError("status.token is missing (client certificates are not supported)")
            expiry = status.get("expirationTimestamp")
            return token, _rfc3339(expiry) if expiry else None
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CredentialRefused("ExecPluginFailed", f"exec plugin {command!r}: unusable answer: {exc}") from None

    return fetch


def file_fetch(path: str) -> Fetch:
    """A token file (a projected ServiceAccount token, one written by a secrets agent), read anew each time."""

    def fetch() -> tuple[str, datetime | None]:
        try:
            with open(path, encoding="utf-8") as handle:
                token = handle.read().strip()
        except OSError as exc:
            raise CredentialRefused("CredentialFileUnreadable", f"token file {path}: {exc.strerror}") from None
        if not token:
            raise CredentialRefused("CredentialFileUnreadable", f"token file {path}: empty")
        return token, None

    return fetch


def token_source(selected: Selected) -> TokenSource | None:
    """The renewing source for the user's token, or None when the kubeconfig's own static means apply."""
    if selected.user.get("exec") is not None:
        return TokenSource(exec_fetch(selected.user["exec"], selected.cluster))
    if selected.user.get("tokenFile") is not None and not selected.user.get("token"):
        return TokenSource(file_fetch(str(selected.user["tokenFile"])), no_expiry=FILE_REFRESH_S)
    return None


def spoke_client(raw: bytes, policy: CredentialPolicy, timeout: tuple[float, float], retries: int | None = None
                 ) -> tuple[Kube, TokenSource | None]:
    """The client for a spoke from its kubeconfig's bytes: checked, its renewing token source wired in as
    the client's key hook, and a first token fetched now (so a plugin that fails is reported at once)."""
    doc = yaml.safe_load(raw)
    selected = check(doc, policy)
    source = token_source(selected)
    plain = copy.deepcopy(doc)
    if source is not None:  # the package must neither run the plugin nor read the file itself
        for item in plain.get("users") or []:
            if isinstance(item, dict) and item.get("name") == selected.user_name:
                item["user"] = {k: v for k, v in item["user"].items() if k not in ("exec", "tokenFile")}
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config_from_dict(plain, client_configuration=config)
    if retries is not None:
        config.retries = retries
    if source is not None:
        config.api_key["BearerToken"] = f"Bearer {source.token()}"

        def refresh(configuration: kubernetes.client.Configuration) -> None:
            configuration.api_key["BearerToken"] = f"Bearer {source.token()}"

        config.refresh_api_key_hook = refresh
    client = kubernetes.client.ApiClient(configuration=config)
    client.user_agent = user_agent()
    return Kube(client, timeout=timeout), source
