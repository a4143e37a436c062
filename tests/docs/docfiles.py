"""The user's documentation as the docs tests read it: README.md, CONTRIBUTING.md and docs/*.md, with their
links, headings and the flags and chart values they name."""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")
FLAG = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    files += [p for p in (ROOT / "CONTRIBUTING.md",) if p.exists()]
    return files


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m and not fenced:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            out.add(base if n == 0 else f"{base}-{n}")
            seen[base] = n + 1
    return out


def links(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in prose_lines(path.read_text()):
        for m in LINK.finditer(line):
            yield number, m.group(1)


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def command_flags() -> dict[str, set[str]]:
    """Every long option of every `embedfleet` command (subcommands included), by command."""
    from embedfleet.runtime.cli import COMMANDS

    out: dict[str, set[str]] = {}
    for name, (module_name, _, text) in COMMANDS.items():
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(prog=f"embedfleet {name}", description=text)
        module.add_arguments(parser)
        out[name] = set(_options(parser))
    return out


def _options(parser: argparse.ArgumentParser) -> Iterator[str]:
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                yield option[2:]
                if isinstance(action, argparse.BooleanOptionalAction) and not option.startswith("--no-"):
                    yield "no-" + option[2:]
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)


def values_keys() -> set[str]:
    """Every key path of the chart's values.yaml ("gateway.replicas", "image.pullPolicy", ...)."""
    import yaml

    values = yaml.safe_load((ROOT / "charts" / "embedfleet" / "values.yaml").read_text())
    out: set[str] = set()

    def walk(node: object, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{prefix}.{key}" if prefix else str(key)
                out.add(path)
                walk(value, path)

    walk(values, "")
    return out
