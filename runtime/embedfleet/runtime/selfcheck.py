"""`embedfleet COMMAND ... --check`: import everything a command can load, then exit.

An image that imports only its entry module proves little: the operator loads its handlers when it
starts, the runtime loads an engine when it reads its settings, and a missing dependency then shows as a
crash-loop in a cluster rather than a failed build. This walks the command's module statically, following
every ``embedfleet`` import it finds, at module level or inside a function, plus module names written as
strings (the operator's role table, which ``importlib`` loads at run time), and imports each module found.
A dependency the command's extra does not install fails here, with the module that needed it.

Only the standard library is used, so the check runs in any installation.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = "embedfleet"


@dataclass
class Closure:
    """The modules a command can load: ours (``modules``) and the third-party top-level names they import."""

    modules: list[str] = field(default_factory=list)
    third_party: dict[str, set[str]] = field(default_factory=dict)  # top-level name -> our modules importing it


def _roots() -> list[Path]:
    """The folders of the ``embedfleet`` namespace package (one per source folder in an editable install)."""
    spec = importlib.util.find_spec(PACKAGE)
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _source(module: str, roots: list[Path]) -> tuple[Path, bool] | None:
    """(file, is_package) of one of our modules, found on disk without importing anything; None if the
    name is not a module (``from embedfleet.x import SomeClass`` names a class)."""
    rel = module.split(".")[1:]
    for root in roots:
        base = root.joinpath(*rel)
        if (base / "__init__.py").is_file():
            return base / "__init__.py", True
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py"), False
    return None


def _named(node: ast.AST, package: str) -> Iterable[str]:
    """Module names one import statement (or one string constant) may refer to."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level:
            parts = package.split(".")
            if node.level > 1:
                parts = parts[: len(parts) - node.level + 1]
            base = ".".join(parts)
            module = f"{base}.{node.module}" if node.module else base
        else:
            module = node.module or ""
        yield module
        for alias in node.names:  # `from pkg import submodule`
            yield f"{module}.{alias.name}"
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
            and node.value.startswith(PACKAGE + ".") and node.value.replace(".", "").replace("_", "").isalnum():
        yield node.value


def closure(entries: Iterable[str]) -> Closure:
    """Every module of ours reachable from ``entries``, and what each imports from outside the package."""
    stdlib = set(sys.stdlib_module_names)
    found = Closure()
    seen: set[str] = set()
    stack = list(entries)
    roots = _roots()
    while stack:
        module = stack.pop()
        if module in seen:
            continue
        located = _source(module, roots)
        if located is None:
            continue
        seen.add(module)
        path, is_package = located
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in _named(node, package):
                top = name.split(".")[0]
                if top == PACKAGE:
                    parts = name.split(".")
                    stack.extend(".".join(parts[:k]) for k in range(2, len(parts) + 1))
                elif top and top not in stdlib and top != "__future__" and not isinstance(node, ast.Constant):
                    found.third_party.setdefault(top, set()).add(module)
    found.modules = sorted(seen)
    return found


def check(entries: Iterable[str]) -> int:
    """Import every module ``closure(entries)`` finds; print what failed. Returns a process exit code."""
    found = closure(entries)
    failed: list[str] = []
    for module in found.modules:
        try:
            importlib.import_module(module)
        except Exception as exc:  # any failure to import is what the check exists to report
            failed.append(f"{module}: {type(exc).__name__}: {exc}")
    if failed:
        print(f"check: {len(failed)} of {len(found.modules)} modules failed to import:", file=sys.stderr)
        for line in failed:
            print(f"  {line}", file=sys.stderr)
        return 1
    print(f"check: ok, {len(found.modules)} modules imported "
          f"({', '.join(sorted(found.third_party)) or 'no third-party packages'})")
    return 0
