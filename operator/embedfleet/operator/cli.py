"""``embedfleet operator run``: start the operator (kopf) in one of its roles.

Settings that handlers read at run time (the Prometheus URL the autoscaler defaults to, this cluster's
region and cloud, the hub's and the spoke heartbeat's intervals) travel as ``EMBEDFLEET_*`` environment
variables, so kopf's handler processes and threads see them without a global config object. An interval
flag left out leaves its variable as it is, so the reading module's default (or an inherited value) applies:
the defaults live in one place, next to the code that uses them.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

ROLES = ("standalone", "spoke", "hub")  # main.ROLE_HANDLERS (not imported here: it pulls in kopf)
ENV_PROMETHEUS_URL = "EMBEDFLEET_PROMETHEUS_URL"
ENV_REGION = "EMBEDFLEET_REGION"
ENV_CLOUD = "EMBEDFLEET_CLOUD"
# The variables the hub controller (hub/controller.py) and the spoke heartbeat (spoke/heartbeat.py) read; the names are
# repeated here, not imported, so that parsing flags never imports the operator's handlers.
ENV_HUB_INTERVAL = "EMBEDFLEET_HUB_INTERVAL"
ENV_HUB_RAMP = "EMBEDFLEET_HUB_RAMP_SECONDS"
ENV_HUB_WRITE_TIMEOUT = "EMBEDFLEET_HUB_WRITE_TIMEOUT"
ENV_HEARTBEAT_INTERVAL = "EMBEDFLEET_HEARTBEAT_INTERVAL"
ENV_HEARTBEAT_DURATION = "EMBEDFLEET_LEASE_DURATION"
# hub/credentials.py's allow-lists for spoke kubeconfigs (comma-separated).
ENV_HUB_EXEC_PLUGINS = "EMBEDFLEET_HUB_EXEC_PLUGINS"
ENV_HUB_CREDENTIAL_DIRS = "EMBEDFLEET_HUB_CREDENTIAL_DIRS"
# metrics.py's (repeated here for the same reason).
ENV_METRICS_PORT = "EMBEDFLEET_OPERATOR_METRICS_PORT"
DEFAULT_METRICS_PORT = 8081


def _seconds(*, allow_zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, > 0 (or >= 0 with ``allow_zero``). A zero or negative
    interval would spin a loop or expire a lease at once; argparse turns the error into exit status 2."""
    bound = "zero or more" if allow_zero else "more than zero"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(f"must be {bound} seconds, got {text!r}")
        return value

    return parse


def _whole_seconds(text: str) -> int:
    """An argparse type: whole seconds >= 1 (a Lease's leaseDurationSeconds is an integer, and the heartbeat
    would silently truncate 2.5 to 2)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not math.isfinite(value) or value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"must be whole seconds, at least 1, got {text!r}")
    return int(value)


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 (off) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {text!r}")
    return value


def metrics_port(args: argparse.Namespace) -> int:
    """The flag, else ``$EMBEDFLEET_OPERATOR_METRICS_PORT``, else the default; 0: no endpoint."""
    if args.metrics_port is not None:
        return int(args.metrics_port)
    text = os.environ.get(ENV_METRICS_PORT, "").strip()
    try:
        return _port(text) if text else DEFAULT_METRICS_PORT
    except argparse.ArgumentTypeError as exc:
        raise ValueError(f"${ENV_METRICS_PORT}: {exc}") from None


def _number(value: float) -> str:
    """As the reading module parses it back: ``10`` rather than ``10.0`` (readable in ``/proc/*/environ``)."""
    return str(int(value)) if value == int(value) else repr(value)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    run_p = sub.add_parser("run", help="run the operator until SIGTERM")
    run_p.add_argument("--role", choices=ROLES, default="standalone",
                       help="standalone: one cluster; spoke: a fleet member; hub: the fleet's control plane")
    scope = run_p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", dest="namespaces", action="append", metavar="NS",
                       help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true",
                       help="watch every namespace (the default when no --namespace is given)")
    run_p.add_argument("--liveness", metavar="URL",
                       help="serve the kubelet's probes from process start: liveness at this URL, readiness "
                            "at /readyz on its port, e.g. http://0.0.0.0:8080/healthz")
    run_p.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                       help="serve the operator's own Prometheus metrics at http://0.0.0.0:PORT/metrics; 0: off "
                            f"(${ENV_METRICS_PORT}; default {DEFAULT_METRICS_PORT})")
    elect = run_p.add_argument_group("leader election (one acting replica; the others wait as standbys)")
    elect.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True,
                       help="hold a coordination.k8s.io Lease before acting (default: on)")
    elect.add_argument("--leader-election-namespace", metavar="NS",
                       help="namespace of the Lease (default: $POD_NAMESPACE, else default)")
    elect.add_argument("--leader-election-id", default="embedfleet-operator", metavar="NAME",
                       help="name of the Lease (default: embedfleet-operator)")
    elect.add_argument("--lease-duration", type=float, default=15.0, metavar="S",
                       help="seconds a standby waits after the last renewal before taking over (default 15)")
    elect.add_argument("--renew-deadline", type=float, default=10.0, metavar="S",
                       help="the leader exits when it could not renew for this long (default 10)")
    elect.add_argument("--retry-period", type=float, default=2.0, metavar="S",
                       help="seconds between renewals and between a standby's attempts (default 2)")
    run_p.add_argument("--prometheus-url", default=os.environ.get(ENV_PROMETHEUS_URL),
                       help="Prometheus for the autoscaler; unset: scrape each pod's /metrics")
    run_p.add_argument("--region", default=os.environ.get(ENV_REGION), help="this cluster's region")
    run_p.add_argument("--cloud", default=os.environ.get(ENV_CLOUD), help="this cluster's cloud provider")
    hub = run_p.add_argument_group("hub (role=hub): the scheduling loop")
    hub.add_argument("--hub-interval", type=_seconds(), metavar="S",
                     help=f"seconds between scheduling rounds (${ENV_HUB_INTERVAL}; default 10)")
    hub.add_argument("--hub-ramp-seconds", type=_seconds(allow_zero=True), metavar="S",
                     help="a spoke that came back grows to its full share over this many seconds; 0: at once "
                          f"(${ENV_HUB_RAMP}; default 60)")
    hub.add_argument("--spoke-write-timeout", type=_seconds(), metavar="S",
                     help="time-out of the hub's writes to one spoke, so one slow spoke cannot stall the others "
                          f"(${ENV_HUB_WRITE_TIMEOUT}; default 10)")
    hub.add_argument("--spoke-exec-plugin", action="append", default=None, metavar="COMMAND",
                     help="an exec credential plugin a spoke's kubeconfig may name, exactly as its exec.command "
                          "(e.g. aws, gke-gcloud-auth-plugin, kubelogin); repeat for several "
                          f"(${ENV_HUB_EXEC_PLUGINS}, comma-separated; default: none)")
    hub.add_argument("--spoke-credential-dir", action="append", default=None, metavar="DIR",
                     help="an absolute directory under which a spoke's kubeconfig may name files (tokenFile, "
                          "certificates): a projected token volume, say; repeat for several "
                          f"(${ENV_HUB_CREDENTIAL_DIRS}, comma-separated; default: none)")
    spoke = run_p.add_argument_group("spoke (role=spoke): the heartbeat Lease the hub reads")
    spoke.add_argument("--heartbeat-interval", type=_seconds(), metavar="S",
                       help=f"seconds between heartbeat renewals (${ENV_HEARTBEAT_INTERVAL}; default 10)")
    spoke.add_argument("--heartbeat-lease-duration", type=_whole_seconds, metavar="S",
                       help="the heartbeat Lease's leaseDurationSeconds, more than the interval "
                            f"(${ENV_HEARTBEAT_DURATION}; default 30)")
    run_p.add_argument("--verbose", action="store_true", help="more logging")
    run_p.add_argument("--debug", action="store_true", help="kopf debug logging")


def interval_env(args: argparse.Namespace) -> dict[str, str]:
    """The variables the given hub and spoke flags set; a flag left out is absent (its variable untouched)."""
    flags = ((ENV_HUB_INTERVAL, args.hub_interval), (ENV_HUB_RAMP, args.hub_ramp_seconds),
             (ENV_HUB_WRITE_TIMEOUT, args.spoke_write_timeout), (ENV_HEARTBEAT_INTERVAL, args.heartbeat_interval),
             (ENV_HEARTBEAT_DURATION, args.heartbeat_lease_duration))
    out = {name: _number(value) for name, value in flags if value is not None}
    for name, values in ((ENV_HUB_EXEC_PLUGINS, getattr(args, "spoke_exec_plugin", None)),
                         (ENV_HUB_CREDENTIAL_DIRS, getattr(args, "spoke_credential_dir", None))):
        if values:
            out[name] = ",".join(values)
    return out


def run(args: argparse.Namespace) -> int:
    if (args.heartbeat_interval is not None and args.heartbeat_lease_duration is not None
            and not args.heartbeat_interval < args.heartbeat_lease_duration):
        # A lease that expires before the next renewal makes the hub see the spoke die between beats.
        print("embedfleet operator: need --heartbeat-interval < --heartbeat-lease-duration, got "
              f"{args.heartbeat_interval:g} >= {args.heartbeat_lease_duration}", file=sys.stderr)
        return 2
    for name, value in ((ENV_PROMETHEUS_URL, args.prometheus_url), (ENV_REGION, args.region),
                        (ENV_CLOUD, args.cloud)):
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    for path in args.spoke_credential_dir or []:
        if not os.path.isabs(path) or "," in path:
            print(f"embedfleet operator: --spoke-credential-dir needs an absolute path without commas, got {path!r}",
                  file=sys.stderr)
            return 2
    for command in args.spoke_exec_plugin or []:
        if not command.strip() or "," in command:
            print(f"embedfleet operator: --spoke-exec-plugin needs a command without commas, got {command!r}",
                  file=sys.stderr)
            return 2
    os.environ.update(interval_env(args))
    # imports kopf and the handlers: only when running
    from embedfleet.operator.main import Election, run_operator

    try:
        election = Election(
            enabled=args.leader_elect, namespace=args.leader_election_namespace, name=args.leader_election_id,
            lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
            retry_period=args.retry_period,
        )
        # A Lease holds whole seconds: the deadline must fall before the duration that is written.
        if not election.retry_period < election.renew_deadline < int(election.lease_duration):
            raise ValueError("need --retry-period < --renew-deadline < --lease-duration (whole seconds)")
        return run_operator(
            role=args.role,
            namespaces=None if args.all_namespaces else args.namespaces,
            liveness_endpoint=args.liveness,
            election=election,
            metrics_port=metrics_port(args),
            verbose=args.verbose,
            debug=args.debug,
        )
    except ValueError as exc:
        print(f"embedfleet operator: {exc}", file=sys.stderr)
        return 2
