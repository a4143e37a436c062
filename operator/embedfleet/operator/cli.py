"""``embedfleet operator run``: start the operator (kopf) in one of its roles.

Settings that handlers read at run time (the Prometheus URL the autoscaler defaults to, this cluster's
region and cloud) travel as ``EMBEDFLEET_*`` environment variables, so kopf's handler processes and
threads see them without a global config object.
"""

from __future__ import annotations

import argparse
import os
import sys

ROLES = ("standalone", "spoke", "hub")
ENV_PROMETHEUS_URL = "EMBEDFLEET_PROMETHEUS_URL"
ENV_REGION = "EMBEDFLEET_REGION"
ENV_CLOUD = "EMBEDFLEET_CLOUD"


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
                       help="serve kopf's liveness probe, e.g. http://0.0.0.0:8080/healthz")
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
    run_p.add_argument("--verbose", action="store_true", help="more logging")
    run_p.add_argument("--debug", action="store_true", help="kopf debug logging")


def run(args: argparse.Namespace) -> int:
    for name, value in ((ENV_PROMETHEUS_URL, args.prometheus_url), (ENV_REGION, args.region),
                        (ENV_CLOUD, args.cloud)):
        if value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    # imports kopf and the handlers: only when running
    from embedfleet.operator.main import Election, run_operator

    try:
        election = Election(
            enabled=args.leader_elect, namespace=args.leader_election_namespace, name=args.leader_election_id,
            lease_duration=args.lease_duration, renew_deadline=args.renew_deadline,
            retry_period=args.retry_period,
        )
        if not election.retry_period < election.renew_deadline < election.lease_duration:
            raise ValueError("need --retry-period < --renew-deadline < --lease-duration")
        return run_operator(
            role=args.role,
            namespaces=None if args.all_namespaces else args.namespaces,
            liveness_endpoint=args.liveness,
            election=election,
            verbose=args.verbose,
            debug=args.debug,
        )
    except ValueError as exc:
        print(f"embedfleet operator: {exc}", file=sys.stderr)
        return 2
