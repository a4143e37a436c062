"""What each PlacementPolicy's status says: the deployments it governs and those whose spec contradicts it.
Pure.

A platform team changing a policy needs to know what it touches before and after: ``deployments`` lists the
EmbeddingDeployments it governs (the highest-priority match of their namespace), ``conflicts`` those whose
inline placement contradicts it (rejected with ``Accepted=False``), each with the sentence the deployment
shows. Lists are capped (the counts are not), so a policy over thousands of deployments stays a small
object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from embedfleet.operator import status as st
from embedfleet.operator.scheduling import Placement

#: How many names (and conflicts) a policy's status lists; the counts cover all of them.
LISTED = 50


def policy_statuses(policies: Mapping[str, Mapping[str, Any]],
                    placements: Mapping[str, Placement]) -> dict[str, dict[str, Any]]:
    """PlacementPolicy name -> the status to hold (conditions without transition times)."""
    governed: dict[str, list[str]] = {name: [] for name in policies}
    conflicts: dict[str, list[dict[str, str]]] = {name: [] for name in policies}
    for key, placement in sorted(placements.items()):
        if placement.policy not in governed:
            continue
        governed[placement.policy].append(key)
        if not placement.accepted:
            conflicts[placement.policy].append({"deployment": key, "message": "; ".join(placement.problems)[:500]})
    out: dict[str, dict[str, Any]] = {}
    for name, pp in policies.items():
        generation = (pp.get("metadata") or {}).get("generation")
        found = conflicts[name]
        message = (f"{len(found)} deployment(s) contradict this policy: "
                   + ", ".join(c["deployment"] for c in found[:5]) + ("..." if len(found) > 5 else "")
                   if found else "no governed deployment contradicts this policy")
        out[name] = {
            "observedGeneration": generation,
            "matchedDeployments": len(governed[name]),
            "deployments": governed[name][:LISTED],
            "conflicts": found[:LISTED],
            "conditions": [st.condition("Conflicts", bool(found), "SpecContradicts" if found else "None",
                                        message, generation)],
        }
    return out
