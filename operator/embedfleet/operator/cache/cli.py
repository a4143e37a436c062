"""``embedfleet cache``: pull verified weights into the node-local cache, or compute a digest.

Exit codes: 0 done, 1 failed after retries (never marked ready), 2 bad input or a source this puller
cannot fetch (the message names the tool or credential that would).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from .digest import MANIFEST_NAME, DigestError, manifest_lines, parse_digest, render_manifest, tree_digest
from .pull import PullFailed, pull


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = sub.add_parser("pull", help="download weights into <cache-dir>/sha256-<hex>/ and verify them")
    p.add_argument("--source", required=True,
                   help="http(s)://host/file (a .tar/.tar.gz is unpacked), http(s)://host/dir/ (with a "
                        "SHA256SUMS manifest), file:///path (file or directory)")
    p.add_argument("--digest", required=True, help="sha256:<hex> of the file/archive, or the dir digest")
    p.add_argument("--cache-dir", required=True, type=Path, help="node-local cache root")
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME"),
                   help="node to label (default: $NODE_NAME, set from the downward API)")
    p.add_argument("--label-node", action="store_true",
                   help="label the node cache.embedfleet.dev/sha256-<16 hex of digest>=ready once verified")
    p.add_argument("--retries", type=int, default=3, help="attempts after the first (default 3)")
    p.add_argument("--backoff", type=float, default=1.0, help="first wait between attempts, doubling (s)")
    p.add_argument("--timeout", type=float, default=60.0, help="HTTP timeout per request (s)")
    p.add_argument("--hold", action="store_true",
                   help="after success keep running until SIGTERM (for a DaemonSet's main container)")
    d = sub.add_parser("digest", help="print the sha256 digest of a file or directory (see docs/cache.md)")
    d.add_argument("path", type=Path)
    d.add_argument("--write-manifest", action="store_true",
                   help=f"also write DIR/{MANIFEST_NAME} so the directory can be served over http(s)")


def _hold() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()


def _pull(args: argparse.Namespace) -> int:
    if args.retries < 0:
        print("embedfleet cache pull: --retries must be >= 0", file=sys.stderr)
        return 2
    if args.label_node and not args.node_name:
        print("embedfleet cache pull: --label-node needs --node-name or $NODE_NAME", file=sys.stderr)
        return 2
    try:
        parse_digest(args.digest)
        result = pull(args.source, args.digest, args.cache_dir, retries=args.retries,
                      backoff_s=args.backoff, timeout_s=args.timeout)
    except DigestError as exc:
        print(f"embedfleet cache pull: {exc}", file=sys.stderr)
        return 2
    except PullFailed as exc:
        print(f"embedfleet cache pull: {exc}; not marked ready", file=sys.stderr)
        return 2 if exc.permanent else 1
    print(f"ready: {result.path} ({result.fetched}; attempts: {result.attempts})")
    if args.label_node:
        from .label import label_key, label_node  # imported here: the kubernetes client is slow to import

        label_node(args.node_name, args.digest)
        print(f"labelled node {args.node_name} {label_key(args.digest)}=ready")
    if args.hold:
        _hold()
    return 0


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
    return _pull(args) if args.action == "pull" else _digest(args)
