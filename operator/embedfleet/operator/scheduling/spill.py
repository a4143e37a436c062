"""Where a deployment's requests may spill when its own cluster cannot serve them soon: the policy's answer.

The gateway of a cluster with no ready replica may forward a request to another cluster's gateway
(gateway/spill.py), but only to the clusters this function names, which the hub writes on each spoke's
copy of the EmbeddingDeployment (annotation `embedfleet.dev/spill-to`):

* ActiveActive: every other cluster the deployment is placed on, best score first;
* RegionLocked: the same, and those are all inside its regions (the region filter placed nothing
  elsewhere), so a request never leaves them, even when that means a 503;
* ActivePassive: only clusters serving as the standby (none while the primary regions are up, since
  the standby then runs nothing to take a request).

Only clusters with a gateway address (FleetCluster `spec.gatewayUrl`) can be named. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from embedfleet.operator.scheduling.model import Placement


def spill_targets(placement: Placement, cluster: str, gateway_urls: Mapping[str, str]) -> list[dict[str, str]]:
    """[{cluster, region, url}] for `cluster`'s copy, in the order its gateway tries them."""
    if not placement.accepted or cluster not in placement.clusters:
        return []
    others = [(name, share) for name, share in placement.clusters.items()
              if name != cluster and share.range.max > 0 and gateway_urls.get(name)]
    if placement.mode == "ActivePassive":
        others = [(name, share) for name, share in others if share.role.startswith("standby")]
    others.sort(key=lambda item: (-item[1].score, item[0]))
    return [{"cluster": name, "region": share.region, "url": gateway_urls[name]} for name, share in others]
