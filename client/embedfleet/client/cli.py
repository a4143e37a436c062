"""`embedfleet embed INPUT --url URL [--url URL2 ...] --out OUT`: the backfill command.

Exit codes: 0 done, 1 the servers failed (completed shards kept; rerun with --resume),
2 bad input or flags, 130 interrupted (Ctrl-C / SIGTERM; completed shards kept).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
from typing import Any

from .backfill import BackfillConfig, BackfillSummary, run_backfill
from .errors import BatchFailedError, ClientError, InputError
from .shards import OUT_FORMATS
from .sources import FORMATS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "input", help="JSONL (one object per line), plain text (one text per line) or Parquet"
    )
    parser.add_argument(
        "--url", action="append", required=True, help="endpoint base URL; repeat for several (failover)"
    )
    parser.add_argument("--out", required=True, help="output directory (shards + manifest.json)")
    parser.add_argument("--input-format", choices=("auto", *FORMATS), default="auto")
    parser.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    parser.add_argument("--format", dest="out_format", choices=OUT_FORMATS, default="parquet")
    parser.add_argument("--shard-size", type=int, default=10_000, help="rows per output shard")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dimensions", type=int, default=None, help="Matryoshka output dimension")
    parser.add_argument("--encoding-format", choices=("base64", "float"), default="base64")
    parser.add_argument("--batch-size", type=int, default=128, help="inputs per request")
    parser.add_argument("--max-concurrent-requests", type=int, default=64)
    parser.add_argument(
        "--shards-in-flight",
        type=int,
        default=2,
        help="shards embedding at once (or waiting for the writer); memory holds at most this + 2",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per request")
    parser.add_argument("--max-retries", type=int, default=5)
    parser.add_argument("--hedge-delay", type=float, default=None, help="re-send requests slower than this")
    parser.add_argument("--spread", action="store_true", help="spread load over all healthy endpoints")
    parser.add_argument(
        "--resume", action="store_true", help="continue a run, skipping shards already written"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("EMBEDFLEET_API_KEY"),
        help="bearer token (env EMBEDFLEET_API_KEY)",
    )


def _progress_bar(total: int, done: int) -> Any:
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=done,
        unit="emb",
        unit_scale=True,
        dynamic_ncols=True,
        file=sys.stderr,
        smoothing=0.1,
    )


async def _main(cfg: BackfillConfig, show_progress: bool) -> tuple[BackfillSummary | None, int]:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():  # second Ctrl-C: stop waiting for in-flight writes
            loop.remove_signal_handler(sig)
            return
        print(f"\n{sig.name}: stopping; completed shards are kept (rerun with --resume)", file=sys.stderr)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    bar: Any = None

    def on_total(total: int, done: int) -> None:
        nonlocal bar
        if show_progress:
            bar = _progress_bar(total, done)

    def on_batch(n: int, errors: int) -> None:
        if bar is not None:
            if errors:
                bar.set_postfix(errors=errors, refresh=False)
            bar.update(n)

    try:
        summary = await run_backfill(cfg, stop, progress=on_batch, on_total=on_total)
    finally:
        if bar is not None:
            bar.close()
    return summary, 130 if summary.interrupted else 0


def run(args: argparse.Namespace) -> int:
    cfg = BackfillConfig(
        input=args.input,
        out=args.out,
        urls=args.url,
        input_format=args.input_format,
        text_field=args.text_field,
        out_format=args.out_format,
        shard_size=args.shard_size,
        model=args.model,
        dimensions=args.dimensions,
        encoding_format=args.encoding_format,
        batch_size=args.batch_size,
        max_concurrent_requests=args.max_concurrent_requests,
        shards_in_flight=args.shards_in_flight,
        resume=args.resume,
        api_key=args.api_key,
        request_timeout=args.timeout,
        max_retries=args.max_retries,
        hedge_delay=args.hedge_delay,
        spread=args.spread,
    )
    try:
        summary, code = asyncio.run(_main(cfg, not args.no_progress))
    except InputError as exc:
        print(f"embedfleet embed: error: {exc}", file=sys.stderr)
        return 2
    except BatchFailedError as exc:
        print(f"embedfleet embed: failed: {exc}", file=sys.stderr)
        print(
            "embedfleet embed: completed shards are kept; fix the cause and rerun with --resume",
            file=sys.stderr,
        )
        return 1
    except ClientError as exc:
        print(f"embedfleet embed: failed: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # bad flag values caught by the client's own checks
        print(f"embedfleet embed: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("embedfleet embed: interrupted", file=sys.stderr)
        return 130
    if summary is not None:
        print(summary.line())
    return code
