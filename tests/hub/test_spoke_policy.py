"""The hub respects each spoke's platform rules: it places a deployment only where that spoke's allow-lists
(images, Secret references, tolerations, host paths, control-plane targeting) accept it, and when replicas
stay unplaced for that reason ``Placed=False`` names each refusing spoke and its problem with the spec.

Unit tests drive the real pieces (the spoke's published policy -> `convert.read_policy` -> `convert.refusals`
-> `place()` -> `convert.conditions`); the last test runs a hub and two spokes on the real test control
plane, each operator started from the chart with its own ``platform`` values.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from embedfleet.operator.crd import naming
from embedfleet.operator.hub import convert
from embedfleet.operator.platform import PlatformPolicy
from embedfleet.operator.scheduling import Cluster, Deployment, Intent, place
from embedfleet.operator.scheduling.filters import REFUSED, SpokePolicy, run_filters
from embedfleet.operator.scheduling.policy import Rules
from embedfleet.operator.scheduling.scores import CACHED_POINTS
from embedfleet.operator.spoke.heartbeat import POLICY_ANNOTATION, lease_body, policy_json
from embedfleet.operator.validate import check
from tests.hub.fleet import DIGEST, Fleet, embedding, errors, hub_user
from tests.kube.controlplane import ControlPlane, wait_until
from tests.kube.fixtures import require_control_plane

TEAM_IMAGE = "registry.example/team/runtime:1"
OTHER_IMAGE = "registry.example/other/runtime:2"
#: Spoke "a" also allows the team's runtime image; spoke "b" keeps the chart's defaults.
A_RULES = PlatformPolicy(allowed_images=["ghcr.io/embedfleet/", TEAM_IMAGE])
B_RULES = PlatformPolicy()


def _spec(image: str, **runtime: Any) -> dict[str, Any]:
    return embedding("x", "ml", 2, runtime={"image": image, **runtime})["spec"]


def _published(policy: PlatformPolicy) -> tuple[str, PlatformPolicy | str]:
    """What the hub makes of what a spoke's heartbeat publishes."""
    annotations = lease_body("ns", "me", 30, [], None, policy=policy_json(policy))["metadata"]["annotations"]
    return convert.read_policy(annotations[POLICY_ANNOTATION])


def _fleet(*named: tuple[str, PlatformPolicy]) -> tuple[list[Cluster], dict[str, PlatformPolicy | str]]:
    clusters, policies = [], {}
    for i, (name, policy) in enumerate(named):
        key, rules = _published(policy)
        policies[key] = rules
        clusters.append(Cluster(name, f"region-{i}", cpu_replicas=10, platform_policy=key))
    return clusters, policies


def _deployment(raw_spec: dict[str, Any], policies: dict[str, PlatformPolicy | str], target: int = 2) -> Deployment:
    return Deployment("ml/x", target, target, refused=convert.refusals(raw_spec, policies))


# ---------------------------------------------------------------- what a spoke publishes, what the hub reads


def test_the_heartbeat_publishes_the_rules_the_hub_reads_back() -> None:
    key, rules = _published(A_RULES)
    assert rules == A_RULES
    # Every field is written (defaults too): the hub judges by the spoke's rules, never by its own defaults.
    assert json.loads(key)["cacheRoot"] == A_RULES.cache_root and "allowControlPlane" in json.loads(key)


def test_a_spoke_that_publishes_no_policy_is_held_to_the_default_rules() -> None:
    key, rules = convert.read_policy(None)
    assert rules == PlatformPolicy() and key == convert.read_policy("")[0] == _published(PlatformPolicy())[0]


def test_the_same_rules_spelled_differently_are_one_policy() -> None:
    terse = json.dumps({"allowedImages": ["ghcr.io/embedfleet/", TEAM_IMAGE]})
    spelled_out = json.dumps({"allowControlPlane": False, "allowedImages": ["ghcr.io/embedfleet/", TEAM_IMAGE],
                              "allowedTolerations": [{"key": "nvidia.com/gpu"}]}, indent=2)
    assert convert.read_policy(terse)[0] == convert.read_policy(spelled_out)[0] == _published(A_RULES)[0]


def test_an_unreadable_policy_refuses_everything_and_says_why() -> None:
    key, rules = convert.read_policy('{"allowedImages": "not-a-list", "futureField": 1}')
    assert isinstance(rules, str) and "cannot read" in rules and "allowedImages" in rules
    refused = convert.refusals(_spec("ghcr.io/embedfleet/runtime:0.1.0"), {key: rules})
    assert refused == {key: rules}


# ---------------------------------------------------------------- verdicts and the filter


def test_a_verdict_is_per_distinct_policy_and_quotes_the_first_problems() -> None:
    clusters, policies = _fleet(("a1", A_RULES), ("a2", A_RULES), ("b", B_RULES))
    assert len(policies) == 2  # a1 and a2 share one verdict
    spec = _spec(OTHER_IMAGE, tolerations=[{"key": "dedicated", "effect": "NoSchedule"}],
                 nodeSelector={"node-role.kubernetes.io/control-plane": ""})
    refused = convert.refusals(spec, policies)
    assert set(refused) == set(policies)
    why = refused[clusters[0].platform_policy]
    assert why.startswith(f"spec.runtime.image: {OTHER_IMAGE!r}") and "tolerations[0]" in why
    assert why.endswith("(and 1 more)")  # the control-plane selector, counted rather than quoted


@pytest.mark.parametrize(
    ("spec", "refusing"),
    [
        (_spec(TEAM_IMAGE), {"b"}),
        (_spec(OTHER_IMAGE), {"a", "b"}),
        (_spec("ghcr.io/embedfleet/runtime:0.1.0"), set()),
        (_spec("ghcr.io/embedfleet/runtime:0.1.0", tolerations=[{"key": "nvidia.com/gpu"}]), set()),
        (_spec("ghcr.io/embedfleet/runtime:0.1.0", tolerations=[{"key": "dedicated"}]), {"a", "b"}),
        ({**_spec(TEAM_IMAGE), "cache": {"storage": {"hostPath": "/etc"}}}, {"a", "b"}),
    ],
)
def test_the_filter_keeps_a_deployment_off_spokes_that_refuse_it(spec: dict[str, Any], refusing: set[str]) -> None:
    clusters, policies = _fleet(("a", A_RULES), ("b", B_RULES))
    d = _deployment(spec, policies)
    filt = SpokePolicy.of(d.refused)
    passed, rejected = run_filters(Rules(), False, tuple(clusters), (filt,) if filt else ())
    assert set(rejected) == refusing and {c.name for c in passed} == {"a", "b"} - refusing
    assert all(reason.startswith(REFUSED) for reason in rejected.values())
    placement = place([d], clusters)["ml/x"]
    assert set(placement.clusters) == {"a", "b"} - refusing


def test_a_refusal_is_reported_before_unavailability() -> None:
    """A refusing spoke that is also down is reported as refusing: that will not pass by itself."""
    key, _ = _published(B_RULES)
    down = Cluster("b", "r", cpu_replicas=10, available=False, platform_policy=key)
    filt = SpokePolicy(((key, "spec.runtime.image: no"),))
    assert run_filters(Rules(), False, (down,), (filt,))[1] == {"b": REFUSED + "spec.runtime.image: no"}
    assert run_filters(Rules(), False, (down,))[1]["b"].startswith("unavailable")


def test_placed_on_the_spoke_that_allows_it_is_placed_and_quiet() -> None:
    clusters, policies = _fleet(("a", A_RULES), ("b", B_RULES))
    placement = place([_deployment(_spec(TEAM_IMAGE), policies)], clusters)["ml/x"]
    assert placement.desired() == {"a": 2} and placement.problems == ()
    assert placement.filtered["b"].startswith(REFUSED + f"spec.runtime.image: {TEAM_IMAGE!r}")
    conds = {c["type"]: c for c in convert.conditions(placement, [], {}, {}, 1)}
    assert conds["Placed"]["status"] == "True" and conds["Degraded"]["status"] == "False"


def test_refused_everywhere_is_placed_false_naming_the_image_and_every_spoke() -> None:
    clusters, policies = _fleet(("a", A_RULES), ("b", B_RULES))
    placement = place([_deployment(_spec(OTHER_IMAGE), policies)], clusters)["ml/x"]
    assert placement.clusters == {}
    placed = {c["type"]: c for c in convert.conditions(placement, [], {}, {}, 1)}["Placed"]
    assert placed["status"] == "False" and placed["reason"] == "Constrained"
    message = placed["message"]
    assert "2 replica(s) unplaced: no cluster passes the filters" in message
    for name, allowed in (("a", TEAM_IMAGE), ("b", "ghcr.io/embedfleet/")):
        assert f"{name}: {REFUSED}spec.runtime.image: {OTHER_IMAGE!r}" in message and allowed in message


def test_refusals_explain_a_shortfall_of_capacity_too() -> None:
    """Refusing spokes are named whenever the deployment is short, not only when nothing is placed."""
    key_a, rules_a = _published(A_RULES)
    key_b, rules_b = _published(B_RULES)
    clusters = [Cluster("a", "r1", cpu_replicas=1, platform_policy=key_a),
                Cluster("b", "r2", cpu_replicas=10, platform_policy=key_b)]
    d = _deployment(_spec(TEAM_IMAGE), {key_a: rules_a, key_b: rules_b}, target=3)
    placement = place([d], clusters)["ml/x"]
    assert placement.desired() == {"a": 1}
    assert placement.problems[0] == "2 replica(s) unplaced: not enough capacity on allowed clusters"
    assert placement.problems[1].startswith(f"b: {REFUSED}spec.runtime.image")


def test_a_cluster_that_starts_refusing_loses_its_share() -> None:
    """A spoke whose rules tightened gets nothing more: its share moves, and the hub deletes its copy."""
    clusters, policies = _fleet(("a", A_RULES), ("b", B_RULES))
    d = Deployment("ml/x", 2, 2, previous={"a": 1, "b": 1}, running={"a": 1, "b": 1},
                   refused=convert.refusals(_spec(TEAM_IMAGE), policies))
    assert place([d], clusters)["ml/x"].desired() == {"a": 2}


POLICY_KEYS = ("p0", "p1", "p2")


@settings(max_examples=150, deadline=None)
@given(
    shape=hs.lists(hs.tuples(hs.sampled_from(POLICY_KEYS), hs.integers(0, 4), hs.booleans(),
                             hs.sampled_from(("r1", "r2"))), min_size=1, max_size=5),
    refusing=hs.sets(hs.sampled_from(POLICY_KEYS)),
    target=hs.integers(0, 8),
    division=hs.sampled_from(("Divided", "Duplicated")),
    min_regions=hs.integers(1, 2),
    previous=hs.dictionaries(hs.sampled_from([f"c{i}" for i in range(5)]), hs.integers(1, 3), max_size=3),
)
def test_refusing_spokes_are_as_if_absent(shape: list[tuple[str, int, bool, str]], refusing: set[str],
                                          target: int, division: str, min_regions: int,
                                          previous: dict[str, int]) -> None:
    """Whatever the fleet: the shares equal those of the same fleet without the refusing spokes (nothing
    else about the placement changes), none goes to a refusing spoke, and when the deployment is short each
    refusing spoke that no earlier filter excluded is named after the problems the smaller fleet reports."""
    clusters = [Cluster(f"c{i}", region, cpu_replicas=cap, available=up, platform_policy=key)
                for i, (key, cap, up, region) in enumerate(shape)]
    intent = Intent(division=division, min_regions=min_regions)  # type: ignore[arg-type]
    refused = {key: f"spec.runtime.image: refused by {key}" for key in refusing}
    d = Deployment("ml/x", target, target, intent=intent, previous=previous, refused=refused)
    full = place([d], clusters)["ml/x"]
    kept = [c for c in clusters if c.platform_policy not in refusing]
    alone = place([Deployment("ml/x", target, target, intent=intent, previous=previous)], kept)["ml/x"]

    assert {n: c.range for n, c in full.clusters.items()} == {n: c.range for n, c in alone.clusters.items()}
    assert not any(clusters[int(n[1:])].platform_policy in refusing for n in full.clusters)
    # (a spoke with no CPU capacity is already out by the GPU/CPU filter, which is what it reports)
    named = [f"{c.name}: {REFUSED}{refused[c.platform_policy]}" for c in clusters
             if c.platform_policy in refusing and c.cpu_replicas > 0]
    short = full.placed < full.target or bool(alone.problems)
    assert full.problems == (*alone.problems, *(named if short else ()))


# ---------------------------------------------------------------- cached weights are per tenant


def test_cached_weights_count_only_for_the_namespace_that_holds_them() -> None:
    """The heartbeat reports node label keys without their prefix; the hub matches each deployment's own
    namespace's key, so team-b's cached copy of the same digest earns team-a nothing."""
    ours = naming.cache_label_key(DIGEST, "ml")[len(naming.CACHE_LABEL_PREFIX):]
    theirs = naming.cache_label_key(DIGEST, "other")[len(naming.CACHE_LABEL_PREFIX):]
    assert convert.digest_key(DIGEST, "ml") == ours != theirs
    parsed, problems = check("x", _spec("ghcr.io/embedfleet/runtime:0.1.0"))
    assert parsed is not None, problems
    d = convert.deployment_from("ml/x", parsed, {}, 2, {})
    assert d.digest == ours
    clusters = [Cluster("holds-ours", "r", cpu_replicas=10, cached_digests=frozenset({ours})),
                Cluster("holds-theirs", "r", cpu_replicas=10, cached_digests=frozenset({theirs}))]
    shares = place([d], clusters)["ml/x"].clusters
    assert shares["holds-ours"].score - shares["holds-theirs"].score == CACHED_POINTS


# ---------------------------------------------------------------- a hub and two spokes, for real

SPOKES = {"a": "eu-west-1", "b": "us-east-1"}
NS = "ml"


@pytest.fixture(scope="module")
def policy_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    require_control_plane()
    workdir = tmp_path_factory.mktemp("policy-fleet")
    plane = ControlPlane.start(workdir / "plane")
    fleet = None
    try:
        hub = plane.add_cluster("hub", nodes=[], controllers=False)
        spokes = {name: plane.add_cluster(name, nodes=[{"name": f"{name}-cpu-1", "region": region}])
                  for name, region in SPOKES.items()}
        # Each cluster's chart `platform` values: its admission policy and its operator enforce them, and the
        # spoke's heartbeat publishes them. The hub stores both images (its own admission policy allows them).
        values = {
            hub.name: {"platform.allowedImages": "{ghcr.io/embedfleet/,registry.example/}"},
            "a": {"platform.allowedImages": f"{{ghcr.io/embedfleet/,{TEAM_IMAGE}}}"},
        }
        fleet = Fleet(plane, workdir, hub, spokes, dict(SPOKES), values=values)
        fleet.install(hub, "hub")
        for name, spoke in spokes.items():
            fleet.install(spoke, "spoke", SPOKES[name])
        for name in spokes:
            fleet.join(name)
        fleet.namespace(NS)
        for name in spokes:
            fleet.start_spoke(name)
        fleet.start_hub()
        yield fleet
    finally:
        if fleet is not None:
            fleet.stop()
        plane.stop()


def _deploy(image: str, name: str, replicas: int) -> dict[str, Any]:
    return embedding(name, NS, replicas, runtime={"image": image,
                                                  "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}})


def _no_unexpected_errors(fleet: Fleet) -> None:
    assert fleet.hub_proc is not None and fleet.hub_proc.alive(), fleet.logs()
    found = errors(fleet.hub.audit(), fleet.hub_proc.user)
    for name, spoke in fleet.spokes.items():
        events = spoke.audit()
        found += errors(events, hub_user(name)) + errors(events, fleet.spoke_procs[name].user)
    assert found == [], "\n".join(found) + "\n" + fleet.logs()


def test_the_hub_places_only_where_each_spokes_rules_allow(policy_fleet: Fleet) -> None:
    fleet = policy_fleet
    fleet.marks()
    fleet.hub.apply(_deploy(TEAM_IMAGE, "team", 2))

    def placed_on_a() -> bool:
        rows = fleet.rows("team", NS)
        return (fleet.condition("team", NS, "Placed").get("status") == "True"
                and {n: r.get("desired") for n, r in rows.items()} == {"a": 2}
                and fleet.copies("team", NS) == {"a": 2})

    try:
        wait_until(placed_on_a, 120, "team placed on a only", interval=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{fleet.hub_object('team', NS).get('status')}\n{fleet.logs()}") from exc
    assert fleet.copy("a", "team", NS)["spec"]["runtime"]["image"] == TEAM_IMAGE
    assert fleet.copy("b", "team", NS) is None
    assert fleet.condition("team", NS, "Degraded").get("status") == "False"

    # An image neither spoke allows: nothing placed, and the hub says where and why.
    fleet.hub.apply(_deploy(OTHER_IMAGE, "other", 1))

    def refused() -> dict[str, Any] | None:
        placed = fleet.condition("other", NS, "Placed")
        return placed if placed.get("status") == "False" and "b: " in placed.get("message", "") else None

    try:
        placed = wait_until(refused, 60, "other refused by both spokes", interval=0.5)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{fleet.hub_object('other', NS).get('status')}\n{fleet.logs()}") from exc
    assert placed["reason"] == "Constrained"
    message = placed["message"]
    for name in SPOKES:
        assert f"{name}: {REFUSED}spec.runtime.image: {OTHER_IMAGE!r}" in message, message
    assert TEAM_IMAGE in message and "ghcr.io/embedfleet/" in message  # each spoke's own allow-list
    time.sleep(4)  # several more hub rounds: still nothing written for it anywhere
    assert fleet.copies("other", NS) == {} and fleet.rows("other", NS) == {}
    # Since the mark: the hub wrote nothing at all to b, and on a it created "team" once and nothing else.
    by_hub = {name: [e for e in spoke.audit() if e.user == hub_user(name) and e.is_write]
              for name, spoke in fleet.spokes.items()}
    assert by_hub["b"] == [], "\n".join(map(str, by_hub["b"]))
    assert [e.verb for e in by_hub["a"] if e.verb == "create"] == ["create"], "\n".join(map(str, by_hub["a"]))
    assert not [e for e in by_hub["a"] if e.name == "other"], "\n".join(map(str, by_hub["a"]))
    assert fleet.copies("team", NS) == {"a": 2}
    _no_unexpected_errors(fleet)
