"""Cost-aware placement: the cost model (cost.py), the learned throughput (learn.py), the price score fed
with costs, ``place()`` ranking by cost per million embeddings, and the status line (explain.py).

Pure functions, so hypothesis properties and table-driven examples; the hub's part (the Lease annotation
read into the smoothed table, the line in ``Placed``) is checked through the same functions the hub calls.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.operator.scheduling import Cluster, Deployment, GPUCapacity, Intent, place
from embedfleet.operator.scheduling.cost import (
    DEFAULT_PARAMS,
    Throughput,
    cost_array,
    cost_per_million,
    params_from_name,
    prior_rate,
)
from embedfleet.operator.scheduling.explain import REASON_CHARS, SHOWN, placement_line
from embedfleet.operator.scheduling.learn import ALPHA, Learned, annotation, ewma, model_identity, parse
from embedfleet.operator.scheduling.model import CPU
from embedfleet.operator.scheduling.scores import PRICE_POINTS, Candidates
from embedfleet.operator.scheduling.scores.price import price as price_score
from embedfleet.operator.spoke.heartbeat import THROUGHPUT_ANNOTATION, lease_body

prices = st.floats(0.0, 100.0, allow_nan=False)
rates = st.floats(1e-3, 1e6, allow_nan=False)
RESOURCES = [CPU, "nvidia-t4", "nvidia-l4", "nvidia-a100-80gb", "nvidia-h100", "nvidia-h200", "unknown-gpu"]
SMALL, LARGE = "hf://sentence-transformers/all-MiniLM-L6-v2", "hf://Qwen/Qwen3-Embedding-8B"


# ---------------------------------------------------------------- the cost model

@given(prices, prices, rates)
def test_cost_is_monotone_in_price(a: float, b: float, rate: float) -> None:
    low, high = sorted((a, b))
    assert cost_per_million(low, rate) <= cost_per_million(high, rate)


@given(prices, rates, rates)
def test_cost_falls_as_throughput_rises(price: float, a: float, b: float) -> None:
    slow, fast = sorted((a, b))
    assert cost_per_million(price, fast) <= cost_per_million(price, slow)


def test_cost_per_million_examples() -> None:
    assert cost_per_million(3.6, 1000.0) == pytest.approx(1.0)  # $3.60/h at 1,000/s: 3.6M an hour, $1/M
    assert cost_per_million(0.0, 5.0) == 0.0
    assert cost_per_million(1.0, 0.0) == math.inf


@given(st.lists(st.tuples(prices, rates), min_size=1, max_size=20))
def test_vectorised_cost_is_bit_equal_to_the_scalar(pairs: list[tuple[float, float]]) -> None:
    p, r = np.array([x for x, _ in pairs]), np.array([y for _, y in pairs])
    assert cost_array(p, r).tolist() == [cost_per_million(x, y) for x, y in pairs]


@given(st.sampled_from(RESOURCES), st.floats(1e6, 1e11), st.floats(1e6, 1e11))
def test_prior_rate_falls_with_model_size(resource: str, a: float, b: float) -> None:
    small, big = sorted((a, b))
    assert prior_rate(resource, big) <= prior_rate(resource, small)


@given(st.sampled_from(RESOURCES), st.integers(1, 8), rates)
def test_measured_overrides_prior(resource: str, per_replica: int, measured: float) -> None:
    model = "hf://org/bge-base-en"
    rate, known = Throughput({(model, resource): measured}).unit_rates(model, per_replica, (resource,))
    units = 1 if resource == CPU else per_replica
    assert known.tolist() == [True] and rate[0] == pytest.approx(measured / units)
    rate, known = Throughput({("hf://other", resource): measured}).unit_rates(model, per_replica, (resource,))
    assert known.tolist() == [False] and rate[0] == prior_rate(resource, params_from_name(model))


def test_a_cpu_pool_wins_for_a_small_model_and_loses_for_a_large_one() -> None:
    cpu_price, h100_price = 0.10, 4.0  # one CPU replica slot, one H100, per hour

    def costs(model: str) -> tuple[float, float]:
        params = params_from_name(model)
        return (cost_per_million(cpu_price, prior_rate(CPU, params)),
                cost_per_million(h100_price, prior_rate("nvidia-h100", params)))

    cpu, gpu = costs(SMALL)
    assert cpu < gpu, (cpu, gpu)
    cpu, gpu = costs(LARGE)
    assert cpu > 2 * gpu, (cpu, gpu)


@pytest.mark.parametrize(("name", "params"), [
    ("hf://Qwen/Qwen3-Embedding-0.6B", 0.6e9),
    ("hf://Qwen/Qwen3-Embedding-8B@main", 8e9),
    ("hf://BAAI/bge-small-en-v1.5", 33e6),
    ("hf://BAAI/bge-large-en-v1.5", 335e6),
    ("hf://intfloat/e5-base-v2", 110e6),
    ("hf://sentence-transformers/all-MiniLM-L6-v2", 22e6),
    ("hf://org/gte-335m", 335e6),
    ("file:///models/mystery", DEFAULT_PARAMS),
    ("", DEFAULT_PARAMS),
])
def test_model_size_from_its_name(name: str, params: float) -> None:
    assert params_from_name(name) == params


# ---------------------------------------------------------------- the score

@given(st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=1, max_size=30))
def test_price_score_is_bounded_and_orders_by_cost(costs: list[float]) -> None:
    c = np.array(costs)
    n = len(c)
    points = price_score(Candidates(np.ones(n), np.ones(n), c, np.full(n, c.min()), np.full(n, c.max()),
                                    np.zeros(n, dtype=np.int64), np.zeros(n, dtype=bool)))
    assert ((points >= -1e-9) & (points <= PRICE_POINTS + 1e-9)).all()
    order = np.argsort(c, kind="stable")
    assert (np.diff(points[order]) <= 1e-9).all()  # cheaper never scores lower
    assert points[int(np.argmin(c))] == pytest.approx(PRICE_POINTS)


# ---------------------------------------------------------------- placement

def _fleet() -> list[Cluster]:
    return [
        Cluster("cheap-per-hour", "eu-west", residency=frozenset({"eu"}), gpus=(GPUCapacity("nvidia-l4", 16, 0.8),)),
        Cluster("cheap-per-embedding", "eu-north", residency=frozenset({"eu"}),
                gpus=(GPUCapacity("nvidia-h100", 16, 2.0),)),
        Cluster("cheapest-but-us", "us-east", residency=frozenset({"us"}), gpus=(GPUCapacity("nvidia-h100", 16, 0.5),)),
    ]


def _one(model: str, throughput: Throughput | None = Throughput()) -> tuple[str, object]:
    d = Deployment("ml/emb", 2, 4, Intent(residency=("eu",), max_clusters=1), gpus_per_replica=1, model=model)
    p = place([d], _fleet(), throughput=throughput)["ml/emb"]
    (name,) = p.desired()
    return name, p


def test_cheaper_per_embedding_wins_over_cheaper_per_hour() -> None:
    name, p = _one(LARGE)
    assert name == "cheap-per-embedding"
    reasons = p.clusters[name].reasons
    assert any(r.endswith("/M embeddings (prior)") for r in reasons), reasons
    # The same fleet ranked by hourly price alone picks the slower, cheaper-per-hour cluster.
    assert _one(LARGE, throughput=None)[0] == "cheap-per-hour"


def test_a_measurement_changes_the_ranking_and_the_reasons() -> None:
    fast_l4 = Throughput({(LARGE, "nvidia-l4"): 400.0})  # L4 replicas measured fast: $0.56/M
    name, p = _one(LARGE, fast_l4)
    assert name == "cheap-per-hour"
    assert "$0.56/M embeddings" in p.clusters[name].reasons


def test_residency_is_never_traded_for_cost() -> None:
    _, p = _one(LARGE)
    assert "cheapest-but-us" not in p.clusters
    assert "residency" in p.filtered["cheapest-but-us"]
    line = placement_line(p)
    assert line.startswith("placement: cheap-per-embedding (nvidia-h100, $")
    assert "cheapest-but-us excluded: missing residency labels ['eu']" in line


def test_a_cpu_pool_is_a_priced_choice_for_a_small_model() -> None:
    clusters = [Cluster("cpu-pool", "eu", cpu_replicas=64, cpu_hourly_price=0.1),
                Cluster("dear-cpu", "eu", cpu_replicas=64, cpu_hourly_price=0.4)]
    d = Deployment("ml/small", 3, 6, Intent(max_clusters=1), model=SMALL)
    p = place([d], clusters)["ml/small"]
    assert p.desired() == {"cpu-pool": 3}
    c = p.clusters["cpu-pool"]
    assert c.cost == pytest.approx(cost_per_million(0.1, prior_rate(CPU, 22e6)))
    assert "cpu at $0.10/h" in c.reasons


def test_the_status_line_stays_short_in_a_large_fleet() -> None:
    clusters = [Cluster(f"c{i:03d}", f"r{i % 7}", residency=frozenset({"eu"} if i % 2 else {"us"}),
                        cpu_replicas=50, cpu_hourly_price=0.1 + i / 1000) for i in range(400)]
    d = Deployment("ml/wide", 100, 200, Intent(residency=("eu",)), model=SMALL)
    line = placement_line(place([d], clusters)["ml/wide"])
    assert f"{200 - SHOWN} more" in line and f"{200 - SHOWN} more excluded" in line
    assert len(line) < 2 * SHOWN * (REASON_CHARS + 60)


# ---------------------------------------------------------------- learning

@given(st.floats(1.0, 1e5), st.floats(1.0, 1e5))
def test_ewma_moves_toward_the_report(old: float, new: float) -> None:
    got = ewma(old, new)
    assert min(old, new) - 1e-9 <= got <= max(old, new) + 1e-9
    assert got == pytest.approx(old + ALPHA * (new - old))
    assert ewma(None, new) == new


def test_learned_table_smooths_reports_and_counts_each_once() -> None:
    model = model_identity("hf://org/bge-base-en", "v1")
    assert model == "hf://org/bge-base-en@v1"
    learned = Learned()
    assert learned.observe("eu", annotation([(model, "nvidia-h100", 1000.0)]))
    assert not learned.observe("eu", annotation([(model, "nvidia-h100", 1000.0)]))  # the same report again
    learned.observe("us", annotation([(model, "nvidia-h100", 2000.0)]))
    assert learned.throughput().measured == {(model, "nvidia-h100"): pytest.approx(1000 + ALPHA * 1000)}
    learned.observe_all({"eu": None, "us": annotation([(model, "nvidia-h100", 2000.0), (model, CPU, 20.0)])})
    assert learned.throughput().measured[(model, CPU)] == 20.0


@pytest.mark.parametrize("bad", [
    "not json", "{}", '[1, "x"]', '[{"model": "m", "resource": "cpu", "perReplica": -1}]',
    '[{"model": "m", "resource": "cpu", "perReplica": "fast"}]', '[{"model": "", "resource": "cpu", "perReplica": 1}]',
    '[{"model": "m", "resource": "cpu", "perReplica": true}]', '[{"model": "m", "resource": "cpu", "perReplica": NaN}]',
])
def test_malformed_reports_are_dropped(bad: str) -> None:
    assert parse(bad) == []
    assert not Learned().observe("eu", bad)


def test_the_heartbeat_carries_a_measurement_and_never_removes_one() -> None:
    text = annotation([("hf://m", "nvidia-l4", 123.456)])
    annotations = lease_body("ns", "me", 30, [], None, throughput=text)["metadata"]["annotations"]
    assert parse(annotations[THROUGHPUT_ANNOTATION]) == [("hf://m", "nvidia-l4", 123.456)]
    assert json.loads(text)[0]["perReplica"] == 123.456
    # Without one, the beat's merge patch leaves the annotation as it is (no null that would remove it).
    assert THROUGHPUT_ANNOTATION not in lease_body("ns", "me", 30, [], None)["metadata"]["annotations"]


@given(st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False))
def test_a_written_figure_reads_back_within_a_part_in_a_hundred_thousand(rate: float) -> None:
    # Any rate, however slow: rounding to decimal places once turned 0.0019 into 0.002, a 5% "change" the spoke
    # rewrote on every beat.
    [(_, _, back)] = parse(annotation([("m", "cpu", rate)]))
    assert math.isclose(back, rate, rel_tol=1e-5)
