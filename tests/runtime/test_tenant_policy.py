"""Pure parts of tenancy: the quota bucket, the fair-share anchor of the batch planner, the keys file."""

from __future__ import annotations

import hashlib
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime.core.batching import Entry, batch_cost, plan_batch
from embedfleet.runtime.core.quota import Bucket, give_back, take
from embedfleet.runtime.tenants import KeysFileError, QuotaExceeded, RequestOverQuota, Tenant, Tenants

KEY_A = "sk-tenant-a-0123456789abcdef"
KEY_B = "sk-tenant-b-0123456789abcdef"


# -- quota ------------------------------------------------------------------------------------
@given(st.integers(1, 10**7), st.floats(0, 1), st.integers(0, 2 * 10**7), st.floats(0, 120))
def test_quota_take_properties(per_minute, fill, tokens, later):
    bucket = Bucket(float(per_minute), per_minute * fill, 0.0)
    outcome = take(bucket, tokens, later)
    refilled = bucket.at_time(later)
    assert 0 <= outcome.bucket.level <= outcome.bucket.capacity
    if outcome.ok:
        assert tokens <= refilled.level + 1e-6 * max(1.0, refilled.rate), "never more than the bucket held"
        assert math.isclose(outcome.bucket.level, max(0.0, refilled.level - tokens), abs_tol=1e-6)
        return
    assert outcome.bucket.level == refilled.level, "a refusal takes nothing"
    if outcome.never:
        assert tokens > per_minute
        return
    assert outcome.retry_after >= 1
    assert take(outcome.bucket, tokens, later + outcome.retry_after).ok, "fits after Retry-After"
    if outcome.retry_after > 1:
        assert not take(outcome.bucket, tokens, later + outcome.retry_after - 1).ok, "and not a second sooner"


@given(st.integers(1, 10**6), st.integers(0, 10**6))
def test_quota_give_back_never_overfills(per_minute, tokens):
    bucket = Bucket.full(per_minute, 0.0)
    after = give_back(take(bucket, tokens, 0.0).bucket, tokens, 0.0)
    assert after.level == pytest.approx(per_minute)


def test_tenant_charge_refuses_with_retry_after_and_gives_back():
    tenant = Tenant("a", tokens_per_minute=600)  # 10 tokens per second
    assert tenant.charge(600, ) is True
    with pytest.raises(QuotaExceeded) as refused:
        tenant.charge(50)
    assert refused.value.retry_after >= 5 and refused.value.reason == "quota"
    assert "600 tokens per minute" in str(refused.value)
    tenant.give_back(600)
    assert tenant.charge(50) is True
    with pytest.raises(RequestOverQuota, match="split it"):
        tenant.charge(601)
    assert Tenant("open").charge(10**9) is False, "no quota: nothing is counted"


# -- fair share in the batch planner ---------------------------------------------------------
queues = st.lists(
    st.builds(Entry, seq=st.integers(0, 10_000), length=st.integers(1, 300), urgent=st.booleans(),
              tenant=st.sampled_from(["a", "b", "c"])),
    max_size=120, unique_by=lambda e: e.seq)
served_maps = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0, 1e6))


@given(queues, served_maps, st.integers(1, 8192), st.integers(1, 64), st.booleans())
def test_plan_batch_serves_the_least_served_tenant_first(queue, served, max_tokens, max_items, packed):
    """Padded or packed (a packed engine's batch counts real tokens and takes the oldest that fit)."""
    chosen = plan_batch(queue, max_tokens, max_items, served=served, packed=packed)
    if not queue:
        assert chosen == []
        return
    urgent = [e for e in queue if e.urgent]
    klass = urgent or queue
    tenant = min({e.tenant for e in klass}, key=lambda t: (served.get(t, 0.0),
                                                          min(e.seq for e in klass if e.tenant == t)))
    anchor = min((e for e in klass if e.tenant == tenant), key=lambda e: e.seq)
    batch = [queue[i] for i in chosen]
    assert anchor in batch, "the least-served tenant's oldest item of the class leads"
    lengths = [e.length for e in batch]
    cost = batch_cost(lengths, packed)
    assert len(batch) <= max_items and (cost <= max_tokens or len(batch) == 1)
    if anchor.urgent:
        assert all(e.urgent for e in batch), "a tenant's fair share never lets bulk work into an urgent batch"
    own = [e for e in klass if e.tenant == tenant]
    if len({e.tenant for e in klass}) > 1 and (len(own) >= max_items or sum(e.length for e in own) >= max_tokens):
        klass = own  # the tenant whose turn it is has a full batch of its own: nobody else's work rides along
        assert all(e.tenant == tenant for e in batch), "another tenant's work filled the batch of this one's turn"
    if packed and len(batch) < max_items:
        room = max_tokens - cost
        assert all(e.length > room for e in klass if e not in batch), "an item that fits was left for later"


def test_one_tenant_backlog_cannot_fill_the_batch_of_another_tenants_turn():
    backlog = [Entry(i, 100, False, "a") for i in range(100)]
    late = [Entry(1000 + i, 100, False, "b") for i in range(3)]
    chosen = plan_batch(backlog + late, max_tokens=3200, max_items=32, served={"a": 50_000.0})
    tenants = [(backlog + late)[i].tenant for i in chosen]
    assert "b" in tenants, "b has been served least: its work goes in the next batch"
    alone = plan_batch(backlog + late, max_tokens=300, max_items=3, served={"a": 50_000.0})
    assert {(backlog + late)[i].tenant for i in alone} == {"b"}, "a full batch of b's own is b's alone"


def test_single_tenant_plans_as_before():
    queue = [Entry(i, length, False) for i, length in enumerate([10, 250, 12, 240, 11, 245, 9, 255])]
    assert sorted(queue[i].length for i in plan_batch(queue, 4 * 255, 4, served={"": 1e9})) == [9, 10, 11, 12]


# -- the keys file ----------------------------------------------------------------------------
def keys_file(tmp_path, text: str):
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return path


def test_keys_file_maps_keys_and_digests_to_tenants(tmp_path):
    digest = hashlib.sha256(KEY_B.encode()).hexdigest()
    tenants = Tenants.from_file(keys_file(tmp_path, f"""
tenants:
  - name: search
    keys: ["{KEY_A}"]
    tokens_per_minute: 1000
    models: [minilm]
  - name: backfill
    keys: ["sha256:{digest}"]
    priority: batch
"""))
    search = tenants.identify(f"Bearer {KEY_A}".encode())
    assert search.name == "search" and search.interactive and search.tokens_per_minute == 1000
    assert search.allows("minilm") and not search.allows("other")
    backfill = tenants.identify(f"Bearer {KEY_B}".encode())
    assert backfill.name == "backfill" and not backfill.interactive and backfill.allows("anything")
    assert tenants.identify(b"Bearer sk-nobody-0123456789abcdef") is None
    assert tenants.identify(None) is None and tenants.identify(KEY_A.encode()) is None


@pytest.mark.parametrize(("text", "says"), [
    ("tenants: []", "tenants"),
    (f"tenants: [{{name: a, keys: ['{KEY_A}']}}, {{name: a, keys: ['{KEY_B}']}}]", "names must be unique: a"),
    (f"tenants: [{{name: a, keys: ['{KEY_A}']}}, {{name: b, keys: ['{KEY_A}']}}]", "both 'a' and 'b'"),
    ("tenants: [{name: a, keys: ['short']}]", "at least 16"),
    ("tenants: [{name: a, keys: ['sha256:abc']}]", "64 lower-case hex"),
    (f"tenants: [{{name: A_b, keys: ['{KEY_A}']}}]", "tenants.0.name"),
    (f"tenants: [{{name: a, keys: ['{KEY_A}'], priority: urgent}}]", "tenants.0.priority"),
    (f"tenants: [{{name: a, keys: ['{KEY_A}'], tokens_per_minute: 0}}]", "tokens_per_minute"),
    (f"tenants: [{{name: a, keys: ['{KEY_A}'], quota: 5}}]", "tenants.0.quota"),
    ("tenants: [unclosed", "not YAML or JSON"),
])
def test_bad_keys_files_are_refused_naming_the_entry(tmp_path, text, says):
    with pytest.raises(KeysFileError) as exc:
        Tenants.from_file(keys_file(tmp_path, text))
    assert says in str(exc.value) and "keys.yaml" in str(exc.value)
    assert KEY_A not in str(exc.value), "a key never appears in an error"


def test_single_key_and_open_access_are_one_default_tenant():
    one = Tenants.single_key(KEY_A)
    assert one.identify(f"Bearer {KEY_A}".encode()).name == "default"
    assert one.identify(b"Bearer wrong") is None
    assert Tenants.open().identify(None).name == "default"
    assert Tenants.open().job_owner("gone").priority == "batch", "a job of a removed tenant still runs"
