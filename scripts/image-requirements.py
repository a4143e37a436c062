"""Print the requirements of embedfleet with the given extras, one per line, read from pyproject.toml alone.

The images install these in a layer of their own before the sources are copied in, so that a change of
source rebuilds only the last, small layer (`pip install --no-deps .`) instead of every dependency: the
real-node tests rebuild the images whenever the sources change. Self-references (``embedfleet[runtime]``)
are expanded; environment markers are kept for pip to judge.

    python scripts/image-requirements.py runtime agent > requirements.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

SELF = re.compile(r"^embedfleet\s*\[([^\]]+)\]\s*$")


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    project = pyproject["project"]
    optional = project.get("optional-dependencies", {})
    out: list[str] = list(project.get("dependencies", []))
    seen: set[str] = set()
    todo = list(extras)
    while todo:
        extra = todo.pop(0)
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"image-requirements: no extra {extra!r} in pyproject.toml")
        seen.add(extra)
        for req in optional[extra]:
            inner = SELF.match(req)
            if inner:
                todo += [e.strip() for e in inner.group(1).split(",")]
            elif req not in out:
                out.append(req)
    return out


def main(argv: list[str]) -> int:
    path = Path(__file__).resolve().parent.parent / "pyproject.toml"
    print("\n".join(requirements(tomllib.loads(path.read_text()), argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
