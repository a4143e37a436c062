"""The `embedfleet` console script.

One entry point for every part of the product. Each subcommand lives next to the code it drives
and is imported only when chosen, so `embedfleet serve` never pays for importing the operator and
`embedfleet operator run` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module exposing `add_arguments(parser)` and `run(args) -> int`, the pyproject extra that installs
# what the command needs, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "serve": ("embedfleet.runtime.serve", "runtime",
              "run the embedding server (OpenAI /v1/embeddings, TEI /embed, ...)"),
    "operator": ("embedfleet.operator.cli", "operator", "run the Kubernetes operator (standalone, spoke or hub)"),
    "cache": ("embedfleet.operator.cache.cli", "agent",
              "node-local model weight cache: pull and verify weights, the node agent"),
    "worker": ("embedfleet.runtime.asyncq.cli", "runtime", "consume async jobs from Redis"),
    "jobs": ("embedfleet.runtime.asyncq.jobs_cli", "runtime", "inspect and replay async jobs (dead-letter stream)"),
    "embed": ("embedfleet.client.cli", "client", "embed a file of texts through one or more endpoints (backfill)"),
    "gateway": ("embedfleet.gateway.cli", "gateway",
                "run the gateway: one front door routing requests by model to runtimes"),
}
CHECK_FLAG = "--check"


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedfleet",
        description="Autoscaled embedding fleets: runtime, operator and client.",
        epilog="Run `embedfleet COMMAND --help` for a command's flags. Any command line followed by --check "
               "parses its flags, imports everything the command can load, and exits (0 when all of it imports).",
    )
    parser.add_argument(
        "command",
        choices=sorted(COMMANDS),
        metavar="COMMAND",
        help="; ".join(f"{name}: {text}" for name, (_, _, text) in sorted(COMMANDS.items())),
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
    module_name, extra, text = COMMANDS[name]
    checking = CHECK_FLAG in rest
    rest = [arg for arg in rest if arg != CHECK_FLAG]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        print(f"embedfleet {name}: not available in this installation ({exc}); "
              f"install it with: pip install 'embedfleet[{extra}]'", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(prog=f"embedfleet {name}", description=text)
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    args.argv = rest  # the command line as given: a split server's supervisor starts its processes with it
    if checking:  # the image's smoke test: the same command line, everything it can load, nothing run
        from embedfleet.runtime.selfcheck import check

        return check([module_name])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
