"""Model names with a revision (`bge-large@r2`) and the headers that pin a request to a vector space."""

from __future__ import annotations

import re

#: A request stamped with this header may only be answered by a runtime serving that vector space.
HEADER_VECTOR_SPACE = "x-embedfleet-vector-space"
#: Every model route's response names the revision that answered it.
HEADER_REVISION = "x-embedfleet-revision"
REVISION_PATTERN = r"^r[1-9][0-9]{0,8}$"
SEPARATOR = "@"
_REVISION = re.compile(REVISION_PATTERN)


def split_model(name: str) -> tuple[str, str | None]:
    """`bge-large@r2` -> ("bge-large", "r2"); a name without a revision suffix -> (name, None). A suffix that
    is not a revision name (`a@b`) is part of the name: model names may contain `@`."""
    base, sep, revision = name.rpartition(SEPARATOR)
    if sep and base and _REVISION.match(revision):
        return base, revision
    return name, None


def with_revision(name: str, revision: str) -> str:
    return f"{name}{SEPARATOR}{revision}"


def revision_number(revision: str) -> int:
    """`r12` -> 12 (revisions sort by number, not as text)."""
    if not _REVISION.match(revision):
        raise ValueError(f"not a revision name: {revision!r} (r1, r2, ...)")
    return int(revision[1:])
