"""How the hub reads a failure of a spoke: a short stable sentence, and whether it is a credential problem.

A credential problem (the kubeconfig cannot be parsed, its token is rejected, its certificate expired, its
identity lacks a right) says nothing about whether the spoke runs: the hub reports it on the FleetCluster
(``CredentialsValid=False``) and keeps the spoke's last known health, instead of failing over every
deployment there as it would for a spoke that stopped answering.
"""

from __future__ import annotations

import ssl

import kubernetes
import urllib3
import yaml

from embedfleet.kit.client import KubeError, describe
from embedfleet.operator.hub.credentials import CredentialRefused

__all__ = ["SPOKE_ERRORS", "credential_problem", "describe"]

#: What a call to a spoke may raise that the hub handles (reported, retried at the next placement pass).
SPOKE_ERRORS = (KubeError, OSError, urllib3.exceptions.HTTPError, kubernetes.config.ConfigException,
                ValueError, yaml.YAMLError)


def credential_problem(exc: BaseException) -> str | None:
    """The reason (a condition reason word) when ``exc`` is a credential problem, else None."""
    if isinstance(exc, CredentialRefused):
        return exc.reason
    if isinstance(exc, KubeError):
        return {401: "Unauthorized", 403: "Forbidden"}.get(exc.status)
    if isinstance(exc, (kubernetes.config.ConfigException, yaml.YAMLError)):
        return "InvalidKubeconfig"
    if isinstance(exc, ValueError) and "kubeconfig" in str(exc).lower():
        return "InvalidKubeconfig"
    reason = getattr(exc, "reason", None)
    for err in (exc, reason, getattr(reason, "__context__", None)):
        if isinstance(err, ssl.SSLCertVerificationError) or "certificate has expired" in str(err or ""):
            return "CertificateInvalid"
    return None
