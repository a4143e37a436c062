"""The `embedfleet` console script.

One entry point for every part of the product. Each subcommand lives next to the code it drives
and is imported only when chosen, so `embedfleet serve` never pays for importing the operator and
`embedfleet operator run` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module exposing `add_arguments(parser)` and `run(args) -> int`, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("embedfleet.runtime.serve", "run the embedding server (OpenAI /v1/embeddings, TEI /embed, ...)"),
    "operator": ("embedfleet.operator.cli", "run the Kubernetes operator (standalone, spoke or hub)"),
    "cache": ("embedfleet.operator.cache.cli", "node-local model weight cache: pull and verify weights"),
    "worker": ("embedfleet.runtime.asyncq.cli", "consume async jobs from Redis"),
    "jobs": ("embedfleet.runtime.asyncq.jobs_cli", "inspect and replay async jobs (dead-letter stream)"),
    "embed": ("embedfleet.client.cli", "embed a file of texts through one or more endpoints (backfill)"),
    "gateway": ("embedfleet.gateway.cli", "run the gateway: one front door routing requests by model to runtimes"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedfleet",
        description="Autoscaled embedding fleets: runtime, operator and client.",
        epilog="Run `embedfleet COMMAND --help` for a command's flags.",
    )
    parser.add_argument(
        "command",
        choices=sorted(COMMANDS),
        metavar="COMMAND",
        help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(COMMANDS.items())),
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        _top_parser().parse_args(argv or ["--help"])
        return 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        _top_parser().parse_args([name])
        return 2
    module_name, text = COMMANDS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"embedfleet {name}: not available in this installation ({exc})", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"embedfleet {name}", description=text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
