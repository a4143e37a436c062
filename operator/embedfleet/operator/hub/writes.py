"""The hub's writes to its spokes: each spoke's planned writes run as one batch on that spoke's own writer
thread (``SpokeLink.writer``), all spokes at once, and a placement pass waits ROUND_WAIT_S at most for them.

Separate from placement because this is the only code that writes to spokes, and it runs on other
threads: one writer per spoke, so a slow or hung spoke delays only its own writes (its batch is reported by
a later pass), never placement or another spoke. Its bookkeeping lives on the link (state.py): the circuit
breaker a spoke failure feeds, the writes a spoke refused (4xx, retried after REFUSAL_RETRY_S), the writes
whose outcome is unknown (looked at before writing again), the namespaces and Secrets already there, and
the newest version the writes produced (placement judges a spoke again once its watch shows it).

On a spoke the hub calls only (see the chart's hub-access.yaml): ``create``/``patch``/``delete``
EmbeddingDeployments; ``get``/``create`` Namespaces; and, where the spoke's chart allows it and the
deployment's PlacementPolicy says ``propagateSecrets``, ``get``/``create``/``patch`` the referenced Secret.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from embedfleet.operator import metrics
from embedfleet.operator.crd import naming
from embedfleet.operator.hub import convert
from embedfleet.operator.hub.errors import SPOKE_ERRORS, describe
from embedfleet.operator.hub.informer import version_at_least
from embedfleet.operator.hub.propagate import Needs, secret_copy
from embedfleet.operator.hub.state import SpokeLink, SpokeView
from embedfleet.operator.kube import Kube, KubeError
from embedfleet.operator.scheduling import ClusterPlacement

log = logging.getLogger(__name__)

ED = naming.EMBEDDING_DEPLOYMENT_KIND
#: A placement pass waits this long at most for the spokes' write batches before it writes status; a batch
#: still running then is reported by a later pass (it delays only its own spoke).
ROUND_WAIT_S = 2.0
#: How often a write a spoke refused (4xx) is tried again while what the hub wants is unchanged.
REFUSAL_RETRY_S = 30.0


@dataclass(frozen=True)
class Write:
    """One planned change on a spoke, run on that spoke's writer thread."""

    key: str  # namespace/name of the hub object
    share: ClusterPlacement | None
    manifest: dict[str, Any] | None  # the copy to apply; None: delete the copy
    live: dict[str, Any] | None
    needs: Needs


@dataclass(frozen=True)
class Outcome:
    live: dict[str, Any] | None
    problem: str | None = None


def fingerprint(manifest: Mapping[str, Any] | None) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest() if manifest else ""


def _version(obj: Mapping[str, Any] | None) -> str:
    return str(((obj or {}).get("metadata") or {}).get("resourceVersion") or "")


class SpokeWrites:
    """Runs a placement pass's plans on the spokes' writer threads; reads the Secrets it propagates on ``hub``."""

    def __init__(self, hub: Kube) -> None:
        self.hub = hub

    def run(self, views: Mapping[str, SpokeView],
            plans: Mapping[str, list[Write]]) -> dict[str, dict[str, Outcome]]:
        """Each spoke's writes on its own thread, all spokes at once; waits ROUND_WAIT_S at most. A spoke
        whose batch is still running afterwards is reported by a later pass (``skipped`` until then)."""
        started: dict[str, concurrent.futures.Future[dict[str, Outcome]]] = {}
        for name, writes in plans.items():
            link = views[name].link
            if writes and link is not None:
                metrics.HUB_WRITES_QUEUED.inc(len(writes))
                link.batch = link.writer.submit(self._timed_batch, link, writes, time.monotonic())
                started[name] = link.batch
        if started:
            concurrent.futures.wait(started.values(), timeout=ROUND_WAIT_S)
        outcomes: dict[str, dict[str, Outcome]] = {}
        for name, future in started.items():
            if future.done():
                outcomes[name] = future.result()
            else:
                views[name].skipped = True
        return outcomes

    def _timed_batch(self, link: SpokeLink, writes: list[Write], queued_at: float) -> dict[str, Outcome]:
        """``_write_batch`` counted in the write queue's metrics (depth, and time from hand-over to done)."""
        try:
            return self._write_batch(link, writes)
        finally:
            metrics.HUB_WRITES_QUEUED.dec(len(writes))
            metrics.HUB_WRITE_BATCH_SECONDS.observe(time.monotonic() - queued_at)

    def _write_batch(self, link: SpokeLink, writes: list[Write]) -> dict[str, Outcome]:
        """Runs on the spoke's writer thread. A failure of the spoke itself (unreachable, time-out, 5xx)
        stops the batch and counts against the spoke's breaker; a refusal of one object (4xx) is that
        object's problem."""
        outcomes: dict[str, Outcome] = {}
        for write in writes:
            try:
                outcomes[write.key] = Outcome(self._write(link, write))
            except SPOKE_ERRORS as exc:
                problem = f"propagation failed: {describe(exc)}"
                outcomes[write.key] = Outcome(write.live, problem)
                if isinstance(exc, KubeError) and 400 <= exc.status < 500:
                    link.refused[write.key] = (time.monotonic(), problem, fingerprint(write.manifest))
                else:
                    link.unsure.add(write.key)
                    link.breaker = link.breaker.failed(time.monotonic(), describe(exc))
                    for rest in writes[writes.index(write) + 1:]:
                        outcomes[rest.key] = Outcome(rest.live, problem)
                    return outcomes
        for key, outcome in outcomes.items():
            if outcome.problem is None:
                link.refused.pop(key, None)
        link.breaker = link.breaker.succeeded()
        return outcomes

    def _write(self, link: SpokeLink, write: Write) -> dict[str, Any] | None:
        kube, namespace = link.kube, write.needs.namespace
        unsure = write.key in link.unsure
        if write.manifest is None:
            assert write.live is not None
            meta = write.live["metadata"]
            answer = kube.delete_object(ED, meta["name"], meta["namespace"])
            if answer is not None and answer.get("kind") == ED:  # held by the spoke operator's finalizer
                self.note_version(link, answer)
            log.info("removed %s from %s", write.key, link.name)
            link.unsure.discard(write.key)
            return None
        if namespace not in link.namespaces:
            if kube.get("Namespace", namespace) is None:
                kube.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {
                    "name": namespace, "labels": {convert.HUB_MANAGED_LABEL: link.name}}})
                log.info("created namespace %s on %s", namespace, link.name)
            link.namespaces.add(namespace)
        for ref in write.needs.secrets:
            self._propagate_secret(link, ref)
        try:
            if unsure:  # the last attempt may have landed: look before writing again
                result, live = kube.apply_object(write.manifest)
            else:
                result, live = kube.apply_object(write.manifest, live=write.live)
        except KubeError as exc:
            if exc.status == 404 and write.live is None:
                link.namespaces.discard(namespace)  # deleted on the spoke since: create it next pass
            raise
        log.info("%s %s on %s: %s", result, write.key, link.name, write.share.range if write.share else "-")
        link.unsure.discard(write.key)
        self.note_version(link, live)
        return live

    def _propagate_secret(self, link: SpokeLink, ref: str) -> None:
        """Copy the hub's Secret ``namespace/name`` to the spoke (only its data and type; labelled as the
        hub's), when its content differs from what the hub last wrote there."""
        namespace, name = ref.split("/", 1)
        source = self.hub.get("Secret", name, namespace)
        if source is None:
            raise KubeError(404, "Not Found", json.dumps({"message": f"Secret {ref} does not exist on the hub"}),
                            f"copy Secret {ref}")
        manifest, digest = secret_copy(source, link.name)
        if link.secrets.get(ref, ("", 0.0))[0] == digest:
            link.secrets[ref] = (digest, time.monotonic())
            return
        live = link.kube.get("Secret", name, namespace)
        if live is not None and ((live.get("metadata") or {}).get("labels") or {}).get(
                convert.HUB_MANAGED_LABEL) != link.name:
            raise KubeError(409, "Conflict", json.dumps({"message": f"Secret {ref} exists on the spoke and was "
                                                         "not written by the hub: it is left alone"}),
                            f"copy Secret {ref}")
        # Never through apply(): its last-applied annotation would hold the Secret's data in clear.
        if live is None:
            link.kube.create(manifest)
        else:
            link.kube.patch_merge("Secret", name, namespace, {"metadata": {"labels": manifest["metadata"]["labels"]},
                                                              "data": manifest["data"]})
        link.secrets[ref] = (digest, time.monotonic())
        log.info("copied Secret %s to %s", ref, link.name)

    @staticmethod
    def note_version(link: SpokeLink, live: Mapping[str, Any] | None) -> None:
        """Remember the newest version the hub's writes produced: the spoke is judged again only once its
        watch shows it (so the next pass does not write the same change twice)."""
        version = _version(live)
        if version and (not link.written or not version_at_least(link.written, version)):
            link.written = version
