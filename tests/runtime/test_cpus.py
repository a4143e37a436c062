"""The cores the runtime sizes by (runtime/cpus.py) and `--fronts auto` (settings.auto_fronts).

Pure parts with hypothesis and fake cgroup trees of both versions laid out as a container and a host
see them; then a real cgroup: a process the kernel holds to half a CPU sizes itself to one core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from embedfleet.runtime import cpus
from embedfleet.runtime.settings import AUTO_MAX_FRONTS, RuntimeSettings, auto_fronts, describe_error

quota = st.tuples(st.integers(-1, 10_000_000), st.integers(-1, 1_000_000))


@given(st.integers(1, 512), st.lists(quota, max_size=4))
def test_cores_are_never_above_the_affinity_nor_the_tightest_quota_nor_below_one(affinity, quotas):
    cores = cpus.cores_from(affinity, quotas)
    assert 1 <= cores <= affinity
    for q, p in quotas:
        if q > 0 and p > 0:
            assert cores <= max(1, -(-q // p))  # the quota in CPUs, rounded up


@given(st.integers(1, 512), st.integers(1, 10_000_000), st.integers(1, 10_000_000), st.integers(1, 1_000_000))
def test_a_larger_quota_never_gives_fewer_cores(affinity, small, extra, period):
    assert cpus.cores_from(affinity, [(small, period)]) <= cpus.cores_from(affinity, [(small + extra, period)])


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_cgroup_v2_quotas_are_read_on_the_process_path_its_parents_and_the_containers_root(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/kubepods/burstable/pod1/ctr\n")
    root = tree(tmp_path / "cg", {
        "kubepods/burstable/pod1/ctr/cpu.max": "150000 100000\n",  # 1.5 CPUs: 2 cores
        "kubepods/burstable/cpu.max": "max 100000\n",
        "kubepods/cpu.max": "800000 100000\n",
    })
    assert sorted(cpus.cgroup_quotas(root, proc)) == [(150000, 100000), (800000, 100000)]
    assert cpus.cores_from(16, cpus.cgroup_quotas(root, proc)) == 2
    # a container's own view: its cgroup is the root of the file system, the path in /proc says "/"
    proc.write_text("0::/\n")
    tree(root, {"cpu.max": "50000 100000\n"})
    assert cpus.cores_from(16, cpus.cgroup_quotas(root, proc)) == 1


def test_cgroup_v1_quotas_and_what_is_not_a_quota(tmp_path):
    proc = tmp_path / "proc_cgroup"
    proc.write_text("5:memory:/kubepods/x\n4:cpu,cpuacct:/kubepods/x\n0::/\n")
    root = tree(tmp_path / "cg", {
        "cpu,cpuacct/kubepods/x/cpu.cfs_quota_us": "300000\n",
        "cpu,cpuacct/kubepods/x/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/kubepods/cpu.cfs_quota_us": "-1\n",  # none
        "cpu,cpuacct/kubepods/cpu.cfs_period_us": "100000\n",
        "memory/kubepods/x/cpu.cfs_quota_us": "1\n",  # not the cpu controller's tree: never read
        "memory/kubepods/x/cpu.cfs_period_us": "100000\n",
        "cpu.max": "garbage\n",
    })
    assert cpus.cgroup_quotas(root, proc) == [(300000, 100000)]
    assert cpus.cores_from(8, cpus.cgroup_quotas(root, proc)) == 3
    # nothing readable: no limit, and no error
    assert cpus.cgroup_quotas(tmp_path / "absent", tmp_path / "absent_proc") == []


def test_auto_fronts_one_process_on_a_cpu_and_on_few_cores_fronts_on_a_gpu_node():
    assert [auto_fronts("cpu", n) for n in (1, 2, 16, 64)] == [0, 0, 0, 0]
    assert [auto_fronts("cuda", n) for n in (1, 2, 3, 4, 6, 10, 16, 128)] == [0, 0, 0, 2, 4, 8, 8, AUTO_MAX_FRONTS]


def test_fronts_setting_takes_a_count_or_auto_and_names_the_mistake(monkeypatch):
    for given_, expected in (("auto", "auto"), ("AUTO", "auto"), ("0", 0), ("4", 4)):
        monkeypatch.setenv("EMBEDFLEET_FRONTS", given_)
        assert RuntimeSettings().fronts == expected
    monkeypatch.delenv("EMBEDFLEET_FRONTS")
    assert RuntimeSettings().fronts == "auto" and RuntimeSettings().front_processes() == 0  # this CPU machine
    # --standby asks for the single process: `auto` gives way to it; a count given outright does not
    assert RuntimeSettings(device="cpu", standby=True).front_processes() == 0
    assert RuntimeSettings(fronts=2, standby=True).front_processes() == 2
    for bad in ("65", "-1", "4.5", "many", ""):
        monkeypatch.setenv("EMBEDFLEET_FRONTS", bad)
        with pytest.raises(Exception) as caught:
            RuntimeSettings()
        message = describe_error(caught.value)
        assert "fronts (--fronts / EMBEDFLEET_FRONTS)" in message and "or 'auto'" in message, message
        assert message.count("\n") == 1, message  # one line for the field, not one per member of the union


def writable_cpu_cgroup() -> tuple[Path, str] | None:
    """A real cgroup file system this test may make a child in: (its folder, its version's quota file)."""
    for folder, quota_file in ((Path("/sys/fs/cgroup/cpu"), "cpu.cfs_quota_us"), (Path("/sys/fs/cgroup"), "cpu.max")):
        if (folder / quota_file).exists() or (folder / "cgroup.controllers").exists():
            if os.access(folder, os.W_OK):
                return folder, quota_file
    return None


def test_a_process_held_to_half_a_cpu_by_its_cgroup_sizes_itself_to_one_core():
    found = writable_cpu_cgroup()
    if found is None or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs a writable cgroup cpu controller (root) and at least two CPUs")
    parent, quota_file = found
    group = parent / f"embedfleet-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {parent}: {exc}")
    try:
        if quota_file == "cpu.max":
            (group / "cpu.max").write_text("50000 100000")
        else:
            (group / "cpu.cfs_period_us").write_text("100000")
            (group / "cpu.cfs_quota_us").write_text("50000")
        procs = group / ("cgroup.procs" if (group / "cgroup.procs").exists() else "tasks")
        # the child joins the cgroup itself before it asks, so what it reads is its own membership
        code = (f"import os; open({str(procs)!r}, 'w').write(str(os.getpid()));"
                "from embedfleet.runtime import cpus; from embedfleet.runtime.settings import RuntimeSettings;"
                "print(cpus.available_cores(), RuntimeSettings().cores(), cpus.summary())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
        cores, settings_cores, summary = out.stdout.split(maxsplit=2)
        assert (cores, settings_cores) == ("1", "1"), out.stdout
        assert "CPU quota 0.5 of" in summary, summary
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError:  # the child's exit is still being accounted
                import time

                time.sleep(0.05)


def test_a_batch_overhead_past_the_planners_bound_is_refused_with_its_name(monkeypatch):
    """Batches under the fixed cost stay out of admission's drain rate: a cost no engine call has would
    leave admission with nothing to learn from, so the setting is bounded like the measured one."""
    from embedfleet.runtime.settings import MAX_OVERHEAD_TOKENS

    monkeypatch.setenv("EMBEDFLEET_BATCH_OVERHEAD_TOKENS", str(MAX_OVERHEAD_TOKENS))
    assert RuntimeSettings().batch_overhead_tokens == MAX_OVERHEAD_TOKENS
    monkeypatch.setenv("EMBEDFLEET_BATCH_OVERHEAD_TOKENS", str(MAX_OVERHEAD_TOKENS + 1))
    with pytest.raises(Exception) as caught:
        RuntimeSettings()
    message = describe_error(caught.value)
    assert "batch_overhead_tokens" in message and str(MAX_OVERHEAD_TOKENS) in message, message
    monkeypatch.setenv("EMBEDFLEET_BATCH_OVERHEAD_TOKENS", "600")
    monkeypatch.setenv("EMBEDFLEET_MAX_BATCH_TOKENS", "512")
    with pytest.raises(Exception) as caught:
        RuntimeSettings()
    message = describe_error(caught.value)
    assert "batch_overhead_tokens (600) is more than max_batch_tokens (512)" in message, message
