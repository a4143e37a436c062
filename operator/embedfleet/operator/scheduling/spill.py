"""Where a deployment's requests may spill when its own cluster cannot serve them soon: the policy's answer.

The gateway of a cluster with no ready replica may forward a request to another cluster's gateway
(gateway/spill.py), but only to the clusters this function names, which the hub writes on each spoke's
copy of the EmbeddingDeployment (annotation `embedfleet.dev/spill-to`):

* ActiveActive: every other cluster the deployment is placed on, best score first;
* RegionLocked: the same, and those are all inside its regions (the region filter placed nothing
  elsewhere), so a request never leaves them, even when that means a 503;
* ActivePassive: only clusters serving as the standby (none while the primary regions are up, since
  the standby then runs nothing to take a request).

Only clusters with a gateway address (FleetCluster `spec.gatewayUrl`) can be named, and, when the hub
knows what each cluster's copy reports (`ready`), only clusters where the deployment has a ready replica:
a spilled request is never spilled again, so sending it to a cluster that is itself starting from cold
(or whose pods all failed) would only hold it there instead of here. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from embedfleet.operator.scheduling.model import Placement


def spill_targets(placement: Placement, cluster: str, gateway_urls: Mapping[str, str],
                  ready: Mapping[str, int] | None = None) -> list[dict[str, str]]:
    """[{cluster, region, url}] for `cluster`'s copy, in the order its gateway tries them. `ready`: the
    deployment's ready replicas per cluster as its copies report them (a cluster missing from it has none
    yet); None: not known, every placed cluster may be named."""
    if not placement.accepted or cluster not in placement.clusters:
        return []
    others = [(name, share) for name, share in placement.clusters.items()
              if name != cluster and share.range.max > 0 and gateway_urls.get(name)
              and (ready is None or ready.get(name, 0) > 0)]
    if placement.mode == "ActivePassive":
        others = [(name, share) for name, share in others if share.role.startswith("standby")]
    others.sort(key=lambda item: (-item[1].score, item[0]))
    return [{"cluster": name, "region": share.region, "url": gateway_urls[name]} for name, share in others]
