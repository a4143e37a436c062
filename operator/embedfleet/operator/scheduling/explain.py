"""One line that says where a deployment runs, what its embeddings cost there, and what was left out and why:
``placement: eu-west (nvidia-h100, $0.41/M embeddings); us-east excluded: region us-east-1 not in ['eu']``.

Pure and bounded: the hub appends it to the ``Placed`` condition, so it names at most `SHOWN` placed and
`SHOWN` excluded clusters (cheapest placed first; clusters a filter excluded before those merely not
selected) and counts the rest, and cuts each reason to `REASON_CHARS`; a fleet of a thousand clusters
writes the same short line as one of three.
"""

from __future__ import annotations

from embedfleet.operator.scheduling.model import ClusterPlacement, Placement, money

SHOWN = 3
REASON_CHARS = 80
NOT_SELECTED = "not selected"


def _where(name: str, c: ClusterPlacement) -> str:
    resource = f"spot {c.resource} up to {c.spot:.0%}" if c.spot else c.resource
    if c.cost is None:
        return f"{name} ({resource}, ${c.price:.2f}/h)"
    return f"{name} ({resource}, {money(c.cost)}{'' if c.measured else ' prior'})"


def placement_line(placement: Placement) -> str:
    """The summary line (empty when the deployment was not accepted: its conditions say why)."""
    if not placement.accepted:
        return ""
    placed = sorted(placement.clusters.items(),
                    key=lambda item: (item[1].cost if item[1].cost is not None else item[1].price, item[0]))
    parts = [_where(name, c) for name, c in placed[:SHOWN]]
    if len(placed) > SHOWN:
        parts.append(f"{len(placed) - SHOWN} more")
    line = "placement: " + ("; ".join(parts) if parts else "nowhere")
    excluded = sorted(placement.filtered.items(), key=lambda item: (item[1].startswith(NOT_SELECTED), item[0]))
    shown = [f"{name} excluded: {why[:REASON_CHARS]}" for name, why in excluded[:SHOWN]]
    if len(excluded) > SHOWN:
        shown.append(f"{len(excluded) - SHOWN} more excluded")
    return "; ".join([line, *shown])
