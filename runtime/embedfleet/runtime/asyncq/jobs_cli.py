"""`embedfleet jobs`: operator tooling for the async queue of one deployment.

Every command names the deployment whose keys it reads, as the runtime derives them: its served
model name (`--deployment`, env EMBEDFLEET_SERVED_MODEL_NAME) or its explicit `--redis-prefix`.

  embedfleet jobs --redis-url URL stats            queue depth, oldest job, counters
  embedfleet jobs --redis-url URL show ID          one job's document (as GET /async/jobs/ID)
  embedfleet jobs --redis-url URL dlq list         dead-lettered webhook deliveries, one JSON line each
  embedfleet jobs --redis-url URL dlq replay [--all | ID ...]   deliver them again (fresh attempts)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import orjson

from embedfleet.runtime.asyncq.keys import Keys
from embedfleet.runtime.asyncq.status import job_document
from embedfleet.runtime.asyncq.store import JobStore, connect


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis-url", default=os.environ.get("EMBEDFLEET_REDIS_URL"),
                        help="Redis of the async queue (default: env EMBEDFLEET_REDIS_URL)")
    parser.add_argument("--deployment", default=os.environ.get("EMBEDFLEET_SERVED_MODEL_NAME"),
                        help="the deployment's served model name(s), comma-separated for a multi-model server "
                        "(default: env EMBEDFLEET_SERVED_MODEL_NAME)")
    parser.add_argument("--redis-prefix", default=os.environ.get("EMBEDFLEET_REDIS_PREFIX"),
                        help="the deployment's --redis-prefix, when it sets one (default: env EMBEDFLEET_REDIS_PREFIX)")
    sub = parser.add_subparsers(dest="action", required=True)
    sub.add_parser("stats", help="queue depth, oldest job age and counters")
    show = sub.add_parser("show", help="one job's status document")
    show.add_argument("job_id")
    dlq = sub.add_parser("dlq", help="the dead-letter stream of webhook deliveries")
    dlq_sub = dlq.add_subparsers(dest="dlq_action", required=True)
    listing = dlq_sub.add_parser("list", help="print dead letters, one JSON object per line")
    listing.add_argument("--limit", type=int, default=1000)
    replay = dlq_sub.add_parser("replay", help="deliver dead letters again")
    replay.add_argument("ids", nargs="*", help="job ids or dead-letter entry ids to replay")
    replay.add_argument("--all", action="store_true", help="replay every dead letter")


async def _run(args: argparse.Namespace) -> int:
    names = [n.strip() for n in (args.deployment or "").split(",") if n.strip()]
    store = JobStore(connect(args.redis_url), Keys.for_deployment(names, args.redis_prefix))
    try:
        if args.action == "stats":
            depth, oldest = await store.depth()
            dead = await store.redis.xlen(store.keys.dead_letters)
            print(orjson.dumps({"queue_depth": depth, "oldest_job_seconds": round(oldest, 3), "dead_letters": dead,
                                **await store.stats()}).decode())
            return 0
        if args.action == "show":
            fields = await store.job(args.job_id)
            if fields is None:
                print(f"embedfleet jobs: no job {args.job_id!r}", file=sys.stderr)
                return 1
            print(job_document(args.job_id, fields).decode())
            return 0
        letters = await store.dead_letters(args.limit if args.dlq_action == "list" else 100_000)
        if args.dlq_action == "list":
            for entry_id, fields in letters:
                print(orjson.dumps({"dlq_id": entry_id, **fields}).decode())
            return 0
        if not args.all and not args.ids:
            print("embedfleet jobs dlq replay: name job ids, or pass --all", file=sys.stderr)
            return 2
        wanted = set(args.ids)
        chosen = [(i, f) for i, f in letters if args.all or i in wanted or f.get("id") in wanted]
        for entry_id, fields in chosen:
            await store.replay(entry_id, fields["id"])
        print(f"replayed {len(chosen)} dead letter(s)")
        missing = wanted - {i for i, _ in chosen} - {f.get("id") for _, f in chosen}
        if missing:
            print(f"not in the dead-letter stream: {sorted(missing)}", file=sys.stderr)
            return 1
        return 0
    finally:
        await store.close()


def run(args: argparse.Namespace) -> int:
    if not args.redis_url:
        print("embedfleet jobs: --redis-url (or EMBEDFLEET_REDIS_URL) is required", file=sys.stderr)
        return 2
    if not args.deployment and not args.redis_prefix:
        print("embedfleet jobs: name the deployment: --deployment SERVED_MODEL_NAME or --redis-prefix PREFIX",
              file=sys.stderr)
        return 2
    return asyncio.run(_run(args))
