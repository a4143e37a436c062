"""Engine builds on a node: where they live, which accelerator each is for, and which are complete.

A build (an int8 OpenVINO model and its gate verdict; a TensorRT-LLM plan) is made by a runtime from
its weights at start-up, minutes of CPU or GPU, and is only good on the kind of processor it was made
and judged on. With pre-pull, the operator gives the runtime pods of a deployment that builds one a
per-tenant, per-model folder on the node, ``<cache root>/<namespace>_engines-sha256-<hex>/``
(`naming.engines_entry`), mounted writable at ENGINES_MOUNT. Inside it:

    <accelerator>/<group>/<build>/      one complete build (published by one rename)
    <accelerator>/<group>/.<build>.lock the build lock (engines/cache_dir.build_lock)
    <accelerator>/<group>/.<build>.*    a build in progress (never read)

``<accelerator>`` names the processor class (`cpu_accelerator`, `gpu_accelerator`); ``<group>`` and
``<build>`` are the engine's own (the model digest; a hash of everything the build depends on). The runtime
and the node agent compute the accelerator name the same way, so the agent can fetch, before any runtime
starts on a node, what another node of the same class built: the CPU class from ``/proc/cpuinfo`` (the
agent runs on the node it serves), the GPU from the product name (``torch.cuda.get_device_name()`` in the
runtime, the node's ``nvidia.com/gpu.product`` label from NVIDIA's GPU feature discovery for the agent;
both read as the same slug).

Standard library only: the runtime imports it too.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import stat
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from . import safefs

#: Where a runtime pod sees its tenant's engines entry (pre-pull and a deployment that builds engines).
ENGINES_MOUNT = "/var/cache/embedfleet/engines"
#: NVIDIA GPU feature discovery's label naming a node's GPU model, e.g. ``NVIDIA-H100-80GB-HBM3``.
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
#: Written by the agent inside a build it fetched from a peer (how the copy came to be); not part of the build.
SOURCE_RECORD = ".source.json"

ACCELERATOR = re.compile(r"^(?:cpu|cuda)-[a-z0-9](?:[-a-z0-9_]{0,62})$")
#: A group or build folder: no leading dot (locks and builds in progress start with one), no separators.
PART = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]{0,127}$")
ENGINES_ENTRY = re.compile(r"^([a-z0-9](?:[-a-z0-9]*[a-z0-9])?)_engines-sha256-([0-9a-f]{64})$")


def slug(text: str, limit: int = 48) -> str:
    """Lower case, every run of other characters one ``-``: ``NVIDIA H100 80GB HBM3`` and GPU feature
    discovery's ``NVIDIA-H100-80GB-HBM3`` both read ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:limit].strip("-") or "unknown"


def _machine(machine: str) -> str:
    m = machine.lower()
    known = {"x86_64": "x86_64", "amd64": "x86_64", "x64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
    return known.get(m, slug(m, 16))


def cpu_isa_class(flags: Collection[str], machine: str) -> str:
    """``cpu-<arch>-<class>``: the widest instruction class an int8 engine would use on this CPU.

    One class per family the kernels differ by (AMX, AVX-512 VNNI, AVX-512, AVX2 on x86; SVE or NEON on
    Arm): a build judged on one class keeps its gate verdict on another machine of the same class, and
    machines of another class build (and judge) their own."""
    arch = _machine(machine)
    have = {f.lower() for f in flags}
    if arch == "x86_64":
        for flag, name in (("amx_int8", "amx"), ("avx512_vnni", "avx512vnni"), ("avx512f", "avx512"),
                           ("avx2", "avx2")):
            if flag in have:
                return f"cpu-{arch}-{name}"
        return f"cpu-{arch}-baseline"
    if arch == "aarch64":
        return f"cpu-{arch}-{'sve' if 'sve' in have else 'neon'}"
    return f"cpu-{arch}-baseline"


def read_cpu_flags(path: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The first ``flags`` (x86) or ``Features`` (Arm) line of /proc/cpuinfo; empty where there is none."""
    try:
        with path.open(encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


@functools.cache
def cpu_accelerator() -> str:
    """This machine's CPU class (`cpu_isa_class` of /proc/cpuinfo and the machine type)."""
    return cpu_isa_class(read_cpu_flags(), platform.machine())


def gpu_accelerator(product: str) -> str:
    """``cuda-<slug of the GPU's product name>``."""
    return f"cuda-{slug(product)}"


def node_accelerators(node_labels: Mapping[str, str], cpu: str) -> list[str]:
    """What builds on this node are made for: its CPU class, and its GPU model where the node is labelled
    with one (a GPU node without the label still serves builds its runtimes made; it fetches none)."""
    out = [cpu]
    product = node_labels.get(GPU_PRODUCT_LABEL)
    if product:
        out.append(gpu_accelerator(product))
    return out


@dataclass(frozen=True, order=True)
class Build:
    accelerator: str
    group: str
    name: str

    @property
    def rel(self) -> str:
        return f"{self.accelerator}/{self.group}/{self.name}"


def _real_dirs(folder: Path, pattern: re.Pattern[str]) -> Iterator[Path]:
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return
    for child in children:
        if pattern.match(child.name) and not child.is_symlink() and child.is_dir():
            yield child


def list_builds(entry_dir: Path, accelerator: str | None = None) -> list[Build]:
    """The complete builds in an engines entry (of one accelerator when given): real directories at
    ``<accelerator>/<group>/<build>`` whose names pass ACCELERATOR and PART (so neither a lock, a build in
    progress nor a symlink planted by whoever can write the folder is ever listed)."""
    out: list[Build] = []
    for acc in _real_dirs(entry_dir, ACCELERATOR):
        if accelerator is not None and acc.name != accelerator:
            continue
        for group in _real_dirs(acc, PART):
            out.extend(Build(acc.name, group.name, build.name) for build in _real_dirs(group, PART))
    return out


class BuildUnavailable(Exception):
    """A build that cannot be offered: gone, or holding something other than regular files and folders."""


_HASHES: dict[tuple[int, int, int, int], str] = {}
_HASHES_MAX = 4096


def _sha256_fd(fd: int, st: os.stat_result) -> str:
    """sha256 of an open file, remembered by (device, inode, size, mtime): builds are written once and
    renamed into place, so a peer asking again does not re-read gigabytes of a plan."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _HASHES:
        h = hashlib.sha256()
        with os.fdopen(os.dup(fd), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        if len(_HASHES) >= _HASHES_MAX:
            _HASHES.clear()
        _HASHES[key] = h.hexdigest()
    return _HASHES[key]


def build_files_at(build_fd: int, label: str) -> list[tuple[str, int, str]]:
    """(relative path, size, sha256) of every file of the build open as ``build_fd``, sorted; BuildUnavailable
    when it holds a link, a device, a pipe or anything but regular files and folders (whoever wrote it is a
    tenant's pod: what the agent serves and copies must be plain bytes inside the folder). Walked by
    directory descriptors, never following a link (`safefs`). The agent's SOURCE_RECORD is left out."""
    out: list[tuple[str, int, str]] = []
    try:
        for rel, name, folder_fd, st in safefs.walk(build_fd):
            if rel == SOURCE_RECORD:
                continue
            if stat.S_ISLNK(st.st_mode):
                raise BuildUnavailable(f"{label}: {rel} is a symlink")
            if not stat.S_ISREG(st.st_mode):
                raise BuildUnavailable(f"{label}: {rel} is not a regular file")
            fd = safefs.open_regular(name, folder_fd)
            try:
                st = os.fstat(fd)
                out.append((rel, st.st_size, _sha256_fd(fd, st)))
            finally:
                os.close(fd)
    except safefs.UnsafePath as exc:
        raise BuildUnavailable(f"{label}: {exc}") from exc
    if not out:
        raise BuildUnavailable(f"{label}: empty")
    return sorted(out)


def build_files(build_dir: Path) -> list[tuple[str, int, str]]:
    """`build_files_at` of the folder ``build_dir`` (itself not a link)."""
    try:
        fd = safefs.open_dir(build_dir)
    except OSError as exc:
        raise BuildUnavailable(f"{build_dir.name}: not held here ({exc})") from exc
    try:
        return build_files_at(fd, build_dir.name)
    finally:
        os.close(fd)
