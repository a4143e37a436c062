"""The operator under test: the chart's own command, arguments and ServiceAccount identity, run as a
real process against a test cluster.

``helm template`` renders the chart for a role; the operator Deployment's container command and args are
taken from it verbatim (only the liveness and metrics ports move to free loopback ports), and the process
authenticates with ``kubectl create token`` of the chart's ServiceAccount. So a rule missing from the
chart's RBAC is a 403 in the audit log, which `OperatorProcess.unexpected_errors` turns into a failure.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.kube.controlplane import ROOT, AuditEvent, Cluster, free_port, wait_until
from tests.procs import child_env, spawn

#: The chart under test; EMBEDFLEET_TEST_CHART points tests at another copy (e.g. a release's).
CHART = Path(os.environ.get("EMBEDFLEET_TEST_CHART") or ROOT / "charts" / "embedfleet")
#: What an operator may be answered without it being a bug: 404 on a GET of something that does not
#: exist yet is how "create if missing" starts; 429 is the server asking to retry (e.g. "storage is
#: (re)initializing" right after a CRD is installed), which clients do.
BENIGN = {(404, "get"), (404, "list"), (404, "delete"), (429, "list"), (429, "watch"), (429, "get")}


def is_election_compare_and_swap(event: AuditEvent) -> bool:
    """The leader renews its election Lease (``<release>-operator``) with a PATCH against the version of
    its own last write; 409 means the Lease changed since, and the leader reads it and decides. That is
    optimistic concurrency working. Any other 409 on a Lease (the spoke's heartbeat, a create) is not."""
    return (event.code == 409 and event.verb == "patch" and event.resource == "leases"
            and event.name.endswith("-operator"))


def is_kopf_patch_precondition(event: AuditEvent) -> bool:
    """kopf writes finalizers with a JSON Patch whose first op tests metadata.resourceVersion; when the
    object changed meanwhile the server answers 422 with this generic message and kopf retries on the
    next event. That is optimistic concurrency working, not a refused object."""
    return (event.code == 422 and event.verb == "patch" and event.user_agent.startswith("kopf/")
            and event.message == "the server rejected our request due to an error in our request")


def deleted_before(event: AuditEvent, audit: Iterable[AuditEvent]) -> bool:
    """A 404 on a patch or update of an object whose delete the API server had received before it answered
    the write (by audit time): a controller that read the object, then wrote to it while a delete it had not
    heard of yet was under way or done. A write received first can still lose: the server reads the object,
    the delete removes it, and the write's update finds it gone. Every controller meets this race; a 404 on
    something never deleted, or deleted only after the answer, is still a failure."""
    if event.code != 404 or event.verb not in ("patch", "update") or not event.name:
        return False
    answered = event.completed or event.received
    return any(e.verb == "delete" and e.code < 300 and e.received <= answered
               and (e.resource, e.namespace, e.name) == (event.resource, event.namespace, event.name)
               for e in audit)


def render_chart(cluster: Cluster, release: str, namespace: str, values: Iterable[Path] = (),
                 sets: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "-n", namespace]
    for path in values:
        args += ["-f", str(path)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    out = cluster.helm(*args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def operator_container(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the operator Deployment, its `operator` container) from rendered chart documents."""
    for doc in docs:
        if doc.get("kind") == "Deployment":
            for container in doc["spec"]["template"]["spec"]["containers"]:
                if container["name"] == "operator":
                    return doc, container
    raise LookupError("the chart rendered no operator Deployment")


@dataclass
class OperatorProcess:
    cluster: Cluster
    popen: subprocess.Popen
    log_path: Path
    user: str
    liveness_port: int
    argv: list[str] = field(default_factory=list)
    #: Where its /metrics answers (EMBEDFLEET_OPERATOR_METRICS_PORT as started), None when not known.
    metrics_port: int | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(10)
        return self.popen.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL, timeout=10)

    def requests(self) -> list[AuditEvent]:
        """Everything the API server answered this operator's identity since the test's mark."""
        return [e for e in self.cluster.audit() if e.user == self.user]

    def writes(self) -> list[AuditEvent]:
        return [e for e in self.requests() if e.is_write]

    def unexpected_errors(self, allow: Iterable[tuple[int, str]] = ()) -> list[AuditEvent]:
        """403/409/422 (and other 4xx but the benign ones) answered to the operator, minus `allow`
        pairs of (code, verb) or (code, resource), and minus writes that lost a race with a delete."""
        allowed = set(allow) | BENIGN
        everything = self.cluster.audit()
        out = []
        for event in (e for e in everything if e.user == self.user):
            if event.code < 400 or event.code >= 500:
                continue
            if is_kopf_patch_precondition(event) or is_election_compare_and_swap(event) \
                    or deleted_before(event, everything):
                continue
            if (event.code, event.verb) in allowed or (event.code, event.resource) in allowed:
                continue
            out.append(event)
        return out


def start_operator(
    cluster: Cluster,
    workdir: Path,
    *,
    release: str,
    namespace: str,
    values: Iterable[Path] = (),
    sets: Mapping[str, str] | None = None,
    env: Mapping[str, str] | None = None,
    name: str = "operator",
    wait_alive: bool = True,
) -> OperatorProcess:
    """Run the chart's operator command as the chart's ServiceAccount (the release must be installed)."""
    docs = render_chart(cluster, release, namespace, values, sets)
    deployment, container = operator_container(docs)
    service_account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    token = cluster.token_for(namespace, service_account)
    kubeconfig = cluster.kubeconfig_for(token, workdir / f"{name}.kubeconfig", namespace=namespace,
                                        user=service_account)
    liveness_port = free_port()
    argv = [*container["command"], *container.get("args", [])]
    argv = [re.sub(r"^--liveness=.*$", f"--liveness=http://127.0.0.1:{liveness_port}/healthz", a) for a in argv]
    if argv[0] == "embedfleet":  # the image's console script is this checkout's CLI
        argv = [sys.executable, "-m", "embedfleet.runtime.cli", *argv[1:]]
    pod_env = {}
    for item in container.get("env", []):
        if "value" in item:
            pod_env[item["name"]] = item["value"]
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
            pod_env[item["name"]] = namespace
        elif item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
            pod_env[item["name"]] = f"{release}-{name}"
    pod_env.pop("HOME", None)
    if "EMBEDFLEET_OPERATOR_METRICS_PORT" in pod_env:  # as the liveness port: several operators share this host
        pod_env["EMBEDFLEET_OPERATOR_METRICS_PORT"] = str(free_port())
    log_path = workdir / f"{name}.log"
    with open(log_path, "ab") as log:
        popen = spawn(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT,
            env=child_env({**pod_env, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1",
                           **(env or {})}),
        )
    started_env = {**pod_env, **(env or {})}
    metrics_port = int(started_env["EMBEDFLEET_OPERATOR_METRICS_PORT"]) \
        if started_env.get("EMBEDFLEET_OPERATOR_METRICS_PORT", "").isdigit() else None
    proc = OperatorProcess(cluster, popen, log_path, f"system:serviceaccount:{namespace}:{service_account}",
                           liveness_port, argv, metrics_port)
    if wait_alive:
        def up() -> bool:
            if not proc.alive():
                raise AssertionError(f"operator exited with {popen.returncode}:\n{proc.log()[-4000:]}")
            return "Starting the main handler" in proc.log() or "acquired leadership" in proc.log()

        try:
            wait_until(up, 60, "the operator to start")
        except TimeoutError as exc:
            proc.kill()
            raise AssertionError(f"{exc}\n{proc.log()[-4000:]}") from exc
    return proc
