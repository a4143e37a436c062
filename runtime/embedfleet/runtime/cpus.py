"""How many cores this process may use: the CPUs it may run on, bounded by its cgroup's CPU quota.

A pod with `resources.limits.cpu: 2` on a 16-core node sees 16 CPUs through `sched_getaffinity`, but the
kernel lets it run for 2 CPUs' worth of time per period. Sized by the 16 (torch's threads, the tokenizer's
workers, the split's fronts), its threads share 2 CPUs of quota: the CFS throttles the whole process for
the rest of every period, and a batch that should take 10 ms takes several periods. So every count the
runtime sizes by cores comes from `available_cores`: the affinity mask, and the quota rounded up (a
limit of 1.5 CPUs gives 2 threads, which the quota still lets run most of the time).

Both cgroup versions are read: v2's `cpu.max` ("QUOTA PERIOD" or "max PERIOD") and v1's
`cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none). Inside a container the cgroup file system is usually
the container's own (a cgroup namespace, or runc's bind mount of its cgroup folder at the mount point),
while /proc/self/cgroup may still name the host's path; both places are read, and the folders above the
process's own, since a parent's quota bounds its children too. The smallest quota found wins.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cores_from(affinity: int, quotas: Iterable[tuple[int, int]]) -> int:
    """The cores to size by: `affinity` (CPUs this process may run on), at most each (quota, period)'s
    CPUs rounded up; at least 1. Periods of 0 or less, and quotas of 0 or less, are no limit."""
    cores = max(1, affinity)
    for quota, period in quotas:
        if quota > 0 and period > 0:
            cores = min(cores, max(1, math.ceil(quota / period)))
    return cores


def parse_cpu_max(text: str) -> tuple[int, int] | None:
    """cgroup v2's cpu.max: "QUOTA PERIOD", or "max PERIOD" (no limit: None)."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        return int(parts[0]), int(parts[1])
    except ValueError:
        return None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _upwards(mount: Path, inner: str) -> Iterator[Path]:
    """`mount`/`inner` and each folder above it up to `mount` itself, then `mount` (the container's view)."""
    parts = [p for p in inner.split("/") if p and p not in (".", "..")]
    for n in range(len(parts), -1, -1):
        yield mount.joinpath(*parts[:n])


def cgroup_quotas(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> list[tuple[int, int]]:
    """Every CPU quota (quota, period in microseconds) that bounds this process, as far as it can read."""
    found: list[tuple[int, int]] = []
    seen: set[Path] = set()
    lines = (_read(proc_cgroup) or "").splitlines() or ["0::/"]
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, inner = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # v2: one unified tree
            mounts = [root, root / "unified"]
            version = 2
        elif "cpu" in controllers.split(","):  # v1: the cpu controller's tree
            mounts = [root / controllers, root / "cpu", root / "cpu,cpuacct"]
            version = 1
        else:
            continue
        for mount in mounts:
            for folder in _upwards(mount, inner):
                try:
                    if folder in seen or not folder.is_dir():
                        continue
                except OSError:  # a folder this process may not look into (EACCES): no quota read there
                    continue
                seen.add(folder)
                if version == 2:
                    limit = parse_cpu_max(_read(folder / "cpu.max") or "")
                else:
                    quota, period = _read(folder / "cpu.cfs_quota_us"), _read(folder / "cpu.cfs_period_us")
                    limit = None  # -1: no quota
                    if quota and period and quota.strip().isdigit() and period.strip().isdigit():
                        limit = int(quota), int(period)
                if limit is not None:
                    found.append(limit)
    return found


def affinity() -> int:
    """CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def readable_quotas(root: Path, proc_cgroup: Path) -> list[tuple[int, int]]:
    """`cgroup_quotas`, or none when the cgroup files cannot be read (the affinity alone then counts)."""
    try:
        return cgroup_quotas(root, proc_cgroup)
    except OSError:
        return []


def available_cores(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int:
    """The cores the runtime sizes its threads and processes by (see the module's docstring); the affinity
    alone when the cgroup files cannot be read."""
    return cores_from(affinity(), readable_quotas(root, proc_cgroup))


def summary(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> str:
    """What `available_cores` found, for the start-up log: "2 cores" or "2 cores (CPU quota 1.5 of 16 CPUs)"."""
    cpus, quotas = affinity(), readable_quotas(root, proc_cgroup)
    cores = cores_from(cpus, quotas)
    if cores == cpus:
        return f"{cores} cores"
    tightest = min(q / p for q, p in quotas if q > 0 and p > 0)
    return f"{cores} cores (CPU quota {tightest:g} of {cpus} CPUs)"
