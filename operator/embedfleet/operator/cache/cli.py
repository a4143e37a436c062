"""``embedfleet cache``: the node agent, its one-time root preparation, pulls into a pod's own cache
(or, with ``--namespace``, a node cache's layout, asking ``--peer`` agents first), the agent's peer server
alone (``serve-peers``), and the digest of a file or directory.

Exit codes: 0 done, 1 failed after retries (never marked ready) or, for ``agent --once``, a pass with a
failure, 2 bad input or a source this puller cannot fetch (the message names the tool or credential
that would) or a cache root the agent cannot write.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from embedfleet.operator.crd import naming

from .digest import MANIFEST_NAME, DigestError, manifest_lines, parse_digest, render_manifest, tree_digest
from .peers import TokenBucket
from .pull import PullFailed, link_node_entry, pull


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 bytes/s, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0-65535), got {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("pull", help="download weights into <cache-dir>/sha256-<hex>/ and verify them")
    p.add_argument("--source", required=True,
                   help="http(s)://host/file (a .tar/.tar.gz is unpacked), http(s)://host/dir/ (with a "
                        "SHA256SUMS manifest), hf://org/name[@rev], file:///path (file or directory)")
    p.add_argument("--digest", required=True, help="sha256:<hex> of the file/archive, or the dir digest")
    p.add_argument("--cache-dir", required=True, type=Path, help="cache directory (a pod's own emptyDir)")
    p.add_argument("--from-node-cache", type=Path, metavar="DIR",
                   help="the node cache's entry for this digest, mounted read-only: when its .ready names "
                        "the digest, <cache-dir>/sha256-<hex> becomes a link to it and nothing is fetched")
    p.add_argument("--retries", type=int, default=3, help="attempts after the first (default 3)")
    p.add_argument("--backoff", type=float, default=1.0, help="first wait between attempts, doubling (s)")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout per request (s)")
    p.add_argument("--max-bytes", type=_positive_int, default=None,
                   help="refuse a source larger than this many bytes (http(s) and hf; default: no limit)")
    p.add_argument("--namespace", metavar="NS",
                   help="the node cache's layout: fill <cache-dir>/<NS>_sha256-<hex> (and ask peers for it)")
    p.add_argument("--peer", action="append", default=[], metavar="URL",
                   help="a node agent's peer server (http://IP:PORT) to ask before the source, in the order "
                        "given; needs --namespace (repeatable)")
    p.add_argument("--peer-rate", type=_rate, default=None, metavar="BYTES_PER_S",
                   help="bandwidth limit for peer downloads (default: none)")
    p.add_argument("--peer-key-file", type=Path, default=None, metavar="PATH",
                   help="sign requests to --peer agents with this key (the release's peer key)")

    a = sub.add_parser("agent", help="keep this node's cache as the cluster's specs want it (node DaemonSet)")
    a.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                   help="this node (default: $NODE_NAME, set from the downward API)")
    a.add_argument("--cache-root", required=True, type=Path,
                   help="where the platform's cache root is mounted in this container")
    a.add_argument("--interval", type=float, default=30.0, help="seconds between passes (default 30)")
    a.add_argument("--retention-seconds", type=float, default=3600.0,
                   help="keep an entry nobody wants this long before deleting it (default 3600)")
    a.add_argument("--max-pull-bytes", type=_positive_int, default=None,
                   help="refuse to download a model larger than this many bytes (default: no limit)")
    a.add_argument("--max-engine-bytes", type=_positive_int, default=None,
                   help="bytes one tenant's engines folder may hold on this node; the oldest builds are "
                        "deleted past it (default: no limit)")
    a.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout per request (s)")
    a.add_argument("--once", action="store_true", help="one pass, then exit (1 if anything in it failed)")
    a.add_argument("--peer-port", type=_port, default=None,
                   help="serve complete entries to other nodes' agents on this port and ask them before the "
                        "origin (default: off)")
    a.add_argument("--peer-host", default="0.0.0.0", help="address the peer server binds (the chart: the pod IP)")
    a.add_argument("--peer-namespace", default=os.environ.get("POD_NAMESPACE", ""),
                   help="namespace of the node-agent pods (default: $POD_NAMESPACE)")
    a.add_argument("--peer-selector", default="",
                   help="label selector of the node-agent pods, e.g. app.kubernetes.io/name=embedfleet-node-agent")
    a.add_argument("--peer-rate", type=_rate, default=None, metavar="BYTES_PER_S",
                   help="bandwidth this node takes from its peers, all downloads together (default: none)")
    a.add_argument("--max-peers", type=int, default=3, help="peers one pull asks before the origin (default 3)")
    a.add_argument("--peer-key-file", type=Path, default=None, metavar="PATH",
                   help="the release's peer key (the chart's Secret): requests between agents are signed with it; "
                        "needed with --peer-port")
    a.add_argument("--health-dir", type=Path, metavar="DIR",
                   help="keep DIR/alive touched while the loop makes progress and DIR/ready present while "
                        "passes can read the cluster, for the kubelet's exec probes (not with --once)")

    r = sub.add_parser("prepare", help="as root: create the cache root and hand it to the agent's uid")
    r.add_argument("--cache-root", required=True, type=Path)
    r.add_argument("--owner", required=True, metavar="UID:GID", help="the agent's uid and gid, e.g. 10001:10001")

    s = sub.add_parser("serve-peers", help="only the agent's read-only peer server, in the foreground")
    s.add_argument("--cache-root", required=True, type=Path)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=_port, default=8476)
    s.add_argument("--peer-key-file", type=Path, default=None, metavar="PATH",
                   help="serve only requests signed with this key (without it: anyone who reaches the port)")

    d = sub.add_parser("digest", help="print the sha256 digest of a file or directory (see docs/cache.md)")
    d.add_argument("path", type=Path)
    d.add_argument("--write-manifest", action="store_true",
                   help=f"also write DIR/{MANIFEST_NAME} so the directory can be served over http(s)")


def _pull(args: argparse.Namespace) -> int:
    if args.retries < 0:
        print("embedfleet cache pull: --retries must be >= 0", file=sys.stderr)
        return 2
    if args.peer and not args.namespace:
        print("embedfleet cache pull: --peer needs --namespace (peers hold tenants' entries)", file=sys.stderr)
        return 2
    try:
        parse_digest(args.digest)
        if args.from_node_cache is not None:
            link = link_node_entry(args.from_node_cache, args.digest, args.cache_dir)
            if link is not None:
                print(f"ready: {link} -> {args.from_node_cache} (node cache)")
                return 0
        entry = naming.cache_entry(args.namespace, args.digest) if args.namespace else None
        result = pull(args.source, args.digest, args.cache_dir, retries=args.retries,
                      backoff_s=args.backoff, timeout_s=args.timeout, max_bytes=args.max_bytes, entry=entry,
                      peers=args.peer, bucket=TokenBucket(args.peer_rate) if args.peer_rate else None,
                      peer_key=_key(args.peer_key_file))
    except (DigestError, KeyUnreadable) as exc:
        print(f"embedfleet cache pull: {exc}", file=sys.stderr)
        return 2
    except PullFailed as exc:
        print(f"embedfleet cache pull: {exc}; not marked ready", file=sys.stderr)
        return 2 if exc.permanent else 1
    print(f"ready: {result.path} ({result.fetched}; source: {result.source}; attempts: {result.attempts})")
    return 0


def _agent(args: argparse.Namespace) -> int:
    from embedfleet.operator import platform

    from .agent import AgentConfig, RootNotWritable
    from .agent import run as run_agent

    if not args.node_name:
        print("embedfleet cache agent: needs --node-name or $NODE_NAME", file=sys.stderr)
        return 2
    if args.peer_port is not None and args.peer_key_file is None:
        print("embedfleet cache agent: --peer-port needs --peer-key-file (agents sign what they ask each other)",
              file=sys.stderr)
        return 2
    try:
        key = _key(args.peer_key_file)
    except KeyUnreadable as exc:
        print(f"embedfleet cache agent: {exc}", file=sys.stderr)
        return 2
    config = AgentConfig(node_name=args.node_name, root=args.cache_root, policy=platform.load(),
                         retention_s=args.retention_seconds, max_pull_bytes=args.max_pull_bytes,
                         pull_timeout_s=args.timeout, peer_port=args.peer_port, peer_host=args.peer_host,
                         peer_namespace=args.peer_namespace, peer_selector=args.peer_selector,
                         peer_rate=args.peer_rate, max_peers=args.max_peers,
                         max_engine_bytes=args.max_engine_bytes, peer_key=key)
    try:
        return run_agent(config, args.interval, args.once, health_dir=args.health_dir)
    except RootNotWritable as exc:
        print(f"embedfleet cache agent: {exc}", file=sys.stderr)
        return 2


def _prepare(args: argparse.Namespace) -> int:
    from .prepare import parse_owner, prepare

    try:
        uid, gid = parse_owner(args.owner)
        changed = prepare(args.cache_root, uid, gid)
    except (ValueError, OSError) as exc:
        print(f"embedfleet cache prepare: {exc}", file=sys.stderr)
        return 2
    print(f"{args.cache_root}: owned by {uid}:{gid}, mode 0755 ({changed} path(s) handed over)")
    return 0


def _serve_peers(args: argparse.Namespace) -> int:
    from .peer_server import serve

    try:
        key = _key(args.peer_key_file)
    except KeyUnreadable as exc:
        print(f"embedfleet cache serve-peers: {exc}", file=sys.stderr)
        return 2
    return serve(args.cache_root, args.host, args.port, key)


class KeyUnreadable(Exception):
    """A --peer-key-file that cannot be read or is too short."""


def _key(path: Path | None):  # -> PeerKey | None
    from .peer_auth import PeerKey

    if path is None:
        return None
    try:
        return PeerKey.from_file(path)
    except (OSError, ValueError) as exc:
        raise KeyUnreadable(f"--peer-key-file {path}: {exc}") from exc


def _digest(args: argparse.Namespace) -> int:
    path: Path = args.path
    if not path.exists():
        print(f"embedfleet cache digest: no such file or directory: {path}", file=sys.stderr)
        return 2
    if args.write_manifest:
        if not path.is_dir():
            print("embedfleet cache digest: --write-manifest needs a directory", file=sys.stderr)
            return 2
        (path / MANIFEST_NAME).write_bytes(render_manifest(manifest_lines(path)))
    print(tree_digest(path))
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    actions = {"pull": _pull, "agent": _agent, "prepare": _prepare, "digest": _digest,
               "serve-peers": _serve_peers}
    return actions[args.action](args)
