"""Pinning a request to a vector space: what the gate checks and stamps, precomputed as header bytes.

A gateway that resolved a model name to a vector space sends `x-embedfleet-vector-space: S`; a replica of
another space (mid-rollout, a breaking revision side by side) must refuse it before any work, so no
answer ever mixes two indexes' vectors. The gate (api/gate.py) does one dict lookup and one set
membership test per request; every answer it lets through names the revision and vector space that
answered (`x-embedfleet-revision`, `x-embedfleet-vector-space`).

The spaces are known before the model loads when --vector-space or --revision names them, else once the
model's files are read (the weights' digest names the space; `serve` is called again then). Until they are known no
request is refused for its space: the model routes answer 503 "loading" anyway.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from embedfleet.compat.names import HEADER_REVISION, HEADER_VECTOR_SPACE

VECTOR_SPACE_HEADER = HEADER_VECTOR_SPACE.encode()
REVISION_HEADER = HEADER_REVISION.encode()
MISMATCH = "vector_space_mismatch"  # the 409's error type and code


@dataclass
class Pinning:
    spaces: frozenset[bytes] = frozenset()
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # stamped on every answer
    revision: str = ""

    def serve(self, revision: str, spaces: Iterable[str]) -> None:
        """Set what this runtime serves. Several models with a space each (no --vector-space given) serve
        all of them; the header lists them, comma-separated."""
        names = sorted(set(spaces))
        self.revision = revision
        self.spaces = frozenset(s.encode() for s in names)
        headers = [(VECTOR_SPACE_HEADER, ",".join(names).encode())] if names else []
        if revision:
            headers.append((REVISION_HEADER, revision.encode()))
        self.headers = headers

    def refuses(self, wanted: bytes | None) -> bool:
        """True when the request is pinned to a space this runtime does not serve."""
        return wanted is not None and bool(self.spaces) and wanted.strip() not in self.spaces

    def mismatch_message(self, wanted: bytes) -> str:
        ours = ", ".join(sorted(s.decode() for s in self.spaces))
        revision = f" (revision {self.revision})" if self.revision else ""
        return (f"the request is pinned to vector space {wanted.decode(errors='replace').strip()!r} "
                f"({HEADER_VECTOR_SPACE}), but this replica serves vector space {ours!r}{revision}: its vectors are "
                "not interchangeable with that space's; send it to a replica of that space")
