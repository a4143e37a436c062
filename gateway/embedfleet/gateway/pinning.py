"""Pinning: a request is answered only by replicas of the vector space its model name resolves to here.

An index is valid for one vector space (docs/rollouts.md). Mid-rollout a model name can be served by
replicas of two spaces at once: a breaking revision side by side (`bge@r2`), the moment a flip moves the
bare name to the new space, two regions of one ActiveActive deployment a wave apart. So the gateway
resolves each request's name to one space and stamps it on the request (`x-embedfleet-vector-space`);
a replica of another space refuses it (409 `vector_space_mismatch`, before any work) and the gateway
tries another of the right space instead of passing the refusal off as an answer.

Where the space comes from:
* Kubernetes: the EmbeddingDeployment's status. The bare served name -> the main Service `<name>` and
  `status.queryVectorSpace`; `<served>@rN` -> Service `<name>-rN` and that revision's `vectorSpace`, for
  every live revision that is not current (`revision_services`).
* Static (`--upstream NAME=URL`): each replica's `vector_space`, learned from its GET /v1/models (and from
  the header on its answers); the name's space is that of the first routable upstream listed
  (`effective_space`), and replicas of another space are left out (never mixed), with a warning.
* A runtime's own default space (`weights-...`, named after its model files, given neither --revision nor
  --vector-space) is not pinned on: it says which files a process loaded, not which revision a platform
  meant the name to resolve to (`label`). Only named spaces (revisions, --vector-space, the operator's) pin.
* A request that already carries the header (spilled in from another region's gateway, or a client that
  pins itself) keeps it: this gateway routes it only to replicas of that space, or refuses it with 409.

Everything here is pure: the fleet and the proxy call it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import orjson

from embedfleet.compat.names import HEADER_VECTOR_SPACE, split_model, with_revision
from embedfleet.gateway.pick import ROUTABLE, State

__all__ = ["HEADER_VECTOR_SPACE", "MISMATCH", "ROUTABLE_STATES", "effective_space", "eligible", "is_mismatch",
           "revision_services", "space_of_cards", "spaces_of_header"]

FINGERPRINT_PREFIX = "weights-"  # a runtime's own default space: `weights-` + 12 hex of its files' digest
MISMATCH = "vector_space_mismatch"  # the runtime's (and a remote gateway's) 409: error type and code
UNAVAILABLE = "vector_space_unavailable"  # this gateway's 503: nothing of the name's space could take it
# A revision that has replicas behind its own Service and answers `<served>@rN`. A Candidate is not gated
# yet (its pods carry vector-space `ungated`), Blocked and Retired ones run nothing.
ROUTABLE_STATES = frozenset({"Serving", "SideBySide", "Draining"})


class Spaced(Protocol):
    state: State
    vector_space: str | None


def revision_services(obj: Mapping[str, Any], served: str) -> list[tuple[str, str, str | None]]:
    """An EmbeddingDeployment -> (model name, Service name, vector space) for each name it answers: the
    bare served name on the main Service (status.queryVectorSpace; None before the operator wrote it: the
    requests then carry no pin), and `<served>@rN` on Service `<name>-rN` for each live revision that is
    not current (its own vectorSpace). The current revision answers only the bare name here: its pods sit
    behind the main Service."""
    name = obj["metadata"]["name"]
    status = obj.get("status") or {}
    out: list[tuple[str, str, str | None]] = [(served, name, status.get("queryVectorSpace") or None)]
    current = status.get("currentRevision")
    for revision in status.get("revisions") or []:
        if not isinstance(revision, Mapping):
            continue
        rev, state = revision.get("name"), revision.get("state")
        if not isinstance(rev, str) or rev == current or state not in ROUTABLE_STATES:
            continue
        if split_model(with_revision(served, rev))[1] != rev:
            continue  # not a revision name (r1, r2, ...): nothing could ask for it
        out.append((with_revision(served, rev), f"{name}-{rev}", revision.get("vectorSpace") or None))
    return out


def is_mismatch(status: int, raw: bytes) -> bool:
    """Is this answer a replica's (or a remote gateway's) refusal for the request's vector space?"""
    if status != 409:
        return False
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False
    error = doc.get("error") if isinstance(doc, dict) else None
    return isinstance(error, dict) and MISMATCH in (error.get("code"), error.get("type"))


def label(space: object) -> str | None:
    """A space this gateway pins on: a named one, not a runtime's fingerprint-derived default."""
    if not isinstance(space, str) or not space or space.startswith(FINGERPRINT_PREFIX):
        return None
    return space


def spaces_of_header(value: str | None) -> frozenset[str]:
    """`x-embedfleet-vector-space` as a runtime stamps it (comma-separated when it serves several)."""
    return frozenset(s.strip() for s in (value or "").split(",") if s.strip())


def space_of_cards(doc: Any, model: str) -> str | None:
    """A runtime's GET /v1/models -> the vector space it serves `model` in: the card named `model` (or
    its bare name), else the one space all its cards share; None when it says none (an older runtime) or
    only its fingerprint's (`label`)."""
    cards = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(cards, list):
        return None
    cards = [c for c in cards if isinstance(c, dict)]
    for wanted in (model, split_model(model)[0]):
        for card in cards:
            if card.get("id") == wanted:
                return label(card.get("vector_space"))
    spaces = {c.get("vector_space") for c in cards}
    return label(next(iter(spaces))) if len(spaces) == 1 else None


def effective_space(declared: str | None, replicas: Iterable[Spaced]) -> str | None:
    """The space a name resolves to: the declared one (the cluster's status, --vector-space), else that of
    the first routable replica (in the order listed) that reported one, else of the first that ever did."""
    if declared is not None:
        return declared
    replicas = list(replicas)
    for replica in replicas:
        if replica.state in ROUTABLE and replica.vector_space is not None:
            return replica.vector_space
    return next((r.vector_space for r in replicas if r.vector_space is not None), None)


def eligible(replica: Spaced, space: str | None) -> bool:
    """May `replica` be sent a request pinned to `space`? Yes unless it reported another space. One that
    reported none yet (not polled, or its /v1/models needs an API key) is tried: the pin rides on the
    request, and a runtime of another space refuses it with 409 before any work."""
    return space is None or replica.vector_space is None or replica.vector_space == space


def serves_elsewhere(replicas: Iterable[Spaced], space: str) -> bool:
    """True when every replica reported a space and none is `space`: nothing here can answer that pin."""
    replicas = list(replicas)
    return bool(replicas) and all(r.vector_space is not None and r.vector_space != space for r in replicas)
