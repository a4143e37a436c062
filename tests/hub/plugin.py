"""A small exec credential plugin for tests, written as an executable script: what `aws eks get-token`,
`gke-gcloud-auth-plugin` or `kubelogin` are to a real hub, since the clouds' CLIs are absent here.

It appends each call (its ``KUBERNETES_EXEC_INFO``) to a log, then prints an ``ExecCredential``. The token is
either minted from the spoke by the TokenRequest API (a bound ServiceAccount token, as a cloud's IAM would
issue one for the hub's identity) or a fixed test string; the stated expiry is ``PLUGIN_LIFETIME`` seconds
from now, shorter than the token's real life, so a test sees renewals within seconds. Its behaviour is set
by the environment the kubeconfig's ``exec.env`` gives it.
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

SCRIPT = r'''
import datetime, json, os, ssl, sys, urllib.request

with open(os.environ["PLUGIN_LOG"], "a") as log:
    log.write(os.environ.get("KUBERNETES_EXEC_INFO", "") + "\n")
mode = os.environ.get("PLUGIN_MODE", "token")
if mode == "fail":
    print("login expired: run the cloud CLI's login again", file=sys.stderr)
    print("second line never shown", file=sys.stderr)
    sys.exit(3)
if mode == "garbage":
    print("this is not json")
    sys.exit(0)
if os.environ.get("PLUGIN_SERVER"):
    ns, sa = os.environ["PLUGIN_SERVICE_ACCOUNT"].split("/")
    request = urllib.request.Request(
        f"{os.environ['PLUGIN_SERVER']}/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", method="POST",
        data=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                         "spec": {"expirationSeconds": 600}}).encode(),
        headers={"Authorization": "Bearer " + os.environ["PLUGIN_ADMIN_TOKEN"],
                 "Content-Type": "application/json"})
    context = ssl.create_default_context(cafile=os.environ["PLUGIN_CA"])
    with urllib.request.urlopen(request, context=context, timeout=10) as answer:
        token = json.load(answer)["status"]["token"]
else:
    token = os.environ.get("PLUGIN_TOKEN", "test-token")
status = {"token": token}
lifetime = os.environ.get("PLUGIN_LIFETIME")
if lifetime:
    expiry = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=float(lifetime))
    status["expirationTimestamp"] = expiry.strftime("%Y-%m-%dT%H:%M:%SZ")
print(json.dumps({"apiVersion": os.environ.get("PLUGIN_API_VERSION", "client.authentication.k8s.io/v1"),
                  "kind": "ExecCredential", "status": status}))
'''


def write_plugin(path: Path) -> Path:
    """The plugin as an executable at ``path`` (run by this test's Python)."""
    path.write_text(f"#!{sys.executable}\n{SCRIPT}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def exec_kubeconfig(server: str, ca_data: str, command: str, env: dict[str, str], user: str = "hub",
                    **exec_extra: object) -> dict:
    """A kubeconfig whose user authenticates with ``command`` as an exec plugin (client-go's v1 protocol)."""
    exec_ = {"apiVersion": "client.authentication.k8s.io/v1", "command": command, "interactiveMode": "Never",
             "env": [{"name": k, "value": v} for k, v in env.items()], **exec_extra}
    return {"apiVersion": "v1", "kind": "Config", "current-context": "spoke",
            "clusters": [{"name": "spoke", "cluster": {"server": server, "certificate-authority-data": ca_data}}],
            "users": [{"name": user, "user": {"exec": exec_}}],
            "contexts": [{"name": "spoke", "context": {"cluster": "spoke", "user": user}}]}

