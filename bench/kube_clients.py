"""The control-plane kit's API client library against an asyncio-native one, on a real kube-apiserver.
One JSON line per figure.

The kit (runtime/embedfleet/kit) talks to Kubernetes through the official, synchronous ``kubernetes``
package, its calls on worker threads. The alternative is ``kubernetes_asyncio`` (aiohttp underneath). Both
are driven here the way the kit drives its client, by raw URL with the answer decoded to plain dicts:

  sync         ``KubeClient.request`` on one ``ApiClient`` made as every component makes it
               (``load_client``: the package's default connection pool, 5 per core), concurrent calls on a
               ``ThreadPoolExecutor`` of --concurrency threads
  sync_pool32  the same with ``connection_pool_maxsize`` = --concurrency (only in the concurrent figures:
               with a pool smaller than the threads, urllib3 discards the connections it cannot keep and
               opens new TLS connections)
  asyncio      ``kubernetes_asyncio`` ``ApiClient.call_api`` on the same path, same headers, body read and
               ``json.loads``'d; concurrent calls as --concurrency coroutines under ``asyncio.gather`` on
               one ``ApiClient`` (its aiohttp pool: 100), on asyncio's default event loop (--loop uvloop:
               on uvloop)

All three use the same admin kubeconfig (bearer token) of one API server of the test control plane
(tests/kube; no controllers, no nodes), in this process, with the server on the same cores. Variants
alternate within every round, the order rotating from round to round; each figure is the median over
--rounds rounds, and ``ratio`` is asyncio / sync from those medians (``ratio_pool32``: asyncio /
sync_pool32). ``better`` says which direction is better for the figure.

Figures:
  get_c1_p50_ms                p50 of one GET of one ConfigMap, one call at a time
  get_c1_cpu_s_per_1000        this process's CPU seconds (time.process_time) per 1,000 of those GETs
  get_c32_calls_per_s          --concurrency GETs in flight
  get_c32_cpu_s_per_1000       CPU seconds per 1,000 GETs at that concurrency
  patch_c32_calls_per_s        merge PATCHes in flight (each call changes one of --concurrency ConfigMaps)
  patch_c32_cpu_s_per_1000     CPU seconds per 1,000 of those PATCHes
  list_s                       seconds for one LIST of --list-size small ConfigMaps (decoded)
  list_cpu_s                   CPU seconds of that LIST
  list_rss_growth_mib          a fresh child process per client: RSS peak during its first LIST (the
                               kernel's high-water mark, reset just before) less its RSS before it (after
                               imports and one GET), median of 3 children each

Needs the control plane built (scripts/kube-tools.sh) and, for the bench only (it is no dependency of
embedfleet), ``pip install kubernetes_asyncio``. Run: python bench/kube_clients.py (about 1 minute on 2
cores). Its lines (the setup, then one per figure) are appended to bench/results/kube-clients-cpu.jsonl with
one run_meta (the run's date tells them from other runs').
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "runtime"), str(ROOT / "client")]

import kubernetes  # noqa: E402

from _common import add_results_dir, record, run_meta  # noqa: E402
from embedfleet.kit.client import TIMEOUT, KubeClient, KubeError  # noqa: E402

NS = "kube-clients"
LIST_NS = "kube-clients-list"
CM_PATH = f"/api/v1/namespaces/{NS}/configmaps"
LIST_PATH = f"/api/v1/namespaces/{LIST_NS}/configmaps"
MISSING = ("kube_clients: kubernetes_asyncio is not installed. It is needed by this bench only (not a "
           "dependency of embedfleet): .venv/bin/pip install kubernetes_asyncio")


def _import_asyncio_client():
    try:
        import kubernetes_asyncio
        import kubernetes_asyncio.client
        import kubernetes_asyncio.config
    except ImportError:
        print(MISSING, file=sys.stderr)
        sys.exit(2)
    return kubernetes_asyncio


# --------------------------------------------------------------------------- the two clients


def sync_client(kubeconfig: Path, pool: int | None = None) -> KubeClient:
    """As the components make it (``load_client``), or with a connection pool of ``pool``."""
    from embedfleet.operator.kube import load_client

    if pool is None:
        return KubeClient(load_client(kubeconfig))
    config = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=config)
    config.connection_pool_maxsize = pool
    return KubeClient(kubernetes.client.ApiClient(configuration=config))


class AsyncKube:
    """``KubeClient.request`` on ``kubernetes_asyncio``: the same path, headers, auth and time-outs; the
    body read whole and decoded with ``json.loads``."""

    def __init__(self, api_client: Any) -> None:
        self.client = api_client

    @classmethod
    async def make(cls, kubeconfig: Path) -> AsyncKube:
        ka = _import_asyncio_client()
        config = ka.client.Configuration()
        await ka.config.load_kube_config(config_file=str(kubeconfig), client_configuration=config)
        return cls(ka.client.ApiClient(configuration=config))

    async def request(self, method: str, path: str, *, body: Any = None, query: list | None = None,
                      content_type: str = "application/json") -> Any:
        headers = {"Accept": "application/json", "Content-Type": content_type}
        response = await self.client.call_api(
            path, method, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"], _preload_content=False, _request_timeout=TIMEOUT)
        data = await response.read()
        if response.status >= 400:
            raise KubeError(response.status, str(response.reason), data.decode("utf-8", "replace"),
                            f"{method} {path}")
        return json.loads(data) if data else {}

    async def close(self) -> None:
        await self.client.close()


# --------------------------------------------------------------------------- one measurement


class Bench:
    def __init__(self, kubeconfig: Path, args: argparse.Namespace) -> None:
        self.args = args
        if args.loop == "uvloop":
            import uvloop

            self.loop = uvloop.new_event_loop()
        else:
            self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.sync = {"sync": sync_client(kubeconfig), "sync_pool32": sync_client(kubeconfig, args.concurrency)}
        self.akube: AsyncKube = self.loop.run_until_complete(AsyncKube.make(kubeconfig))
        self.pool = concurrent.futures.ThreadPoolExecutor(args.concurrency, thread_name_prefix="kube")

    def close(self) -> None:
        self.pool.shutdown()
        self.loop.run_until_complete(self.akube.close())
        self.loop.close()

    # the same work, three ways: each returns (wall seconds, cpu seconds, per-call seconds or [])

    def _timed(self, run: Callable[[], list[float]]) -> tuple[float, float, list[float]]:
        gc.collect()
        c0, t0 = time.process_time(), time.perf_counter()
        samples = run()
        return time.perf_counter() - t0, time.process_time() - c0, samples

    def sequential(self, variant: str, n: int, method: str, path: str) -> tuple[float, float, list[float]]:
        if variant == "asyncio":
            async def go() -> list[float]:
                out = []
                for _ in range(n):
                    t = time.perf_counter()
                    await self.akube.request(method, path)
                    out.append(time.perf_counter() - t)
                return out
            return self._timed(lambda: self.loop.run_until_complete(go()))
        kube = self.sync[variant]

        def run() -> list[float]:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                kube.request(method, path)
                out.append(time.perf_counter() - t)
            return out
        return self._timed(run)

    def concurrent(self, variant: str, n: int, call: Callable[[int], tuple[str, str, Any, str]]
                   ) -> tuple[float, float, list[float]]:
        """n calls, ``--concurrency`` in flight; ``call(i)`` is (method, path, body, content type)."""
        c = self.args.concurrency
        if variant == "asyncio":
            async def worker(k: int) -> None:
                for i in range(k, n, c):
                    method, path, body, ctype = call(i)
                    await self.akube.request(method, path, body=body, content_type=ctype)

            async def go() -> list[float]:
                await asyncio.gather(*(worker(k) for k in range(c)))
                return []
            return self._timed(lambda: self.loop.run_until_complete(go()))
        kube = self.sync[variant]

        def one(i: int) -> None:
            method, path, body, ctype = call(i)
            kube.request(method, path, body=body, content_type=ctype)

        def run() -> list[float]:
            for f in [self.pool.submit(one, i) for i in range(n)]:
                f.result()
            return []
        return self._timed(run)


def _rotate(variants: list[str], r: int) -> list[str]:
    k = r % len(variants)
    return variants[k:] + variants[:k]


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def figure(name: str, better: str, per_round: dict[str, list[float]], digits: int = 4, **extra: Any) -> dict:
    med = {v: round(_median(xs), digits) for v, xs in per_round.items()}
    out: dict[str, Any] = {"bench": "kube_clients", "figure": name, "better": better, **med}
    if med.get("sync"):
        out["ratio"] = round(med["asyncio"] / med["sync"], 3)
    if med.get("sync_pool32"):
        out["ratio_pool32"] = round(med["asyncio"] / med["sync_pool32"], 3)
    out["per_round"] = {v: [round(x, digits) for x in xs] for v, xs in per_round.items()}
    out.update(extra)
    return out


# --------------------------------------------------------------------------- RSS of one LIST, in a child


def rss_child(variant: str, kubeconfig: Path) -> None:
    """Run in a fresh process: RSS before one LIST (after imports and a GET), its peak during the LIST (the
    kernel's high-water mark, reset just before), and after (the items still held)."""
    def status_kib(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0

    def rss_kib() -> int:
        gc.collect()
        before = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
        return before

    if variant == "asyncio":
        async def go() -> tuple[int, int, int]:
            kube = await AsyncKube.make(kubeconfig)
            try:
                await kube.request("GET", f"{CM_PATH}/one")
                before = rss_kib()
                items = (await kube.request("GET", LIST_PATH))["items"]
                return before, status_kib("VmHWM"), len(items)
            finally:
                await kube.close()
        before, peak, count = asyncio.run(go())
    else:
        kube = sync_client(kubeconfig)
        kube.request("GET", f"{CM_PATH}/one")
        before = rss_kib()
        items = kube.request("GET", LIST_PATH)["items"]
        peak, count = status_kib("VmHWM"), len(items)
    print(json.dumps({"before_kib": before, "peak_kib": peak, "after_kib": status_kib("VmRSS"), "items": count}))


def rss_growth(variant: str, kubeconfig: Path) -> dict[str, float]:
    done = subprocess.run([sys.executable, __file__, "--rss-child", variant, "--kubeconfig", str(kubeconfig)],
                          capture_output=True, text=True, timeout=120, check=True)
    data = json.loads(done.stdout.strip().splitlines()[-1])
    return {"peak": (data["peak_kib"] - data["before_kib"]) / 1024,
            "held": (data["after_kib"] - data["before_kib"]) / 1024, "items": data["items"]}


# --------------------------------------------------------------------------- the run


def machine() -> dict[str, Any]:
    from importlib.metadata import version

    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        cpu = platform.processor() or "unknown"
    versions = {}
    for pkg in ("kubernetes", "kubernetes_asyncio", "urllib3", "aiohttp"):
        try:
            versions[pkg] = version(pkg)
        except Exception:
            versions[pkg] = None
    from tests.kube.controlplane import KUBE_VERSION

    return {"cpus": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "kube_apiserver": KUBE_VERSION, **versions, "loadavg_start": round(os.getloadavg()[0], 2)}


def populate(bench: Bench, list_size: int, concurrency: int) -> None:
    kube = bench.sync["sync_pool32"]
    for ns in (NS, LIST_NS):
        kube.request("POST", "/api/v1/namespaces", body={"metadata": {"name": ns}})
    kube.request("POST", CM_PATH, body={"metadata": {"name": "one"}, "data": {"key": "value", "n": "1"}})
    for k in range(concurrency):
        kube.request("POST", CM_PATH, body={"metadata": {"name": f"p{k}"}, "data": {"n": "0"}})

    def make(i: int) -> None:
        kube.request("POST", LIST_PATH, body={"metadata": {"name": f"cm-{i:05d}", "labels": {"app": "bench"}},
                                              "data": {"index": str(i), "value": f"small value {i}"}})
    list(bench.pool.map(make, range(list_size)))


def run(args: argparse.Namespace) -> int:
    _import_asyncio_client()
    # the default pool (10 on 2 cores) under 32 threads warns on every connection it discards
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    from tests.kube.controlplane import ControlPlane, missing_reason

    reason = missing_reason()
    if reason:
        print(json.dumps({"bench": "kube_clients", "skipped": reason}))
        return 0
    started = time.monotonic()
    info = machine()
    workdir = Path(tempfile.mkdtemp(prefix="embedfleet-bench-"))
    plane = ControlPlane.start(workdir)
    try:
        cluster = plane.add_cluster("clients", nodes=[], controllers=False)
        kubeconfig = cluster.kubeconfig
        bench = Bench(kubeconfig, args)
        try:
            t = time.monotonic()
            populate(bench, args.list_size, args.concurrency)
            populate_s = time.monotonic() - t
            one = f"{CM_PATH}/one"
            # the three see the same object and the same list
            sync_one = bench.sync["sync"].request("GET", one)
            async_one = bench.loop.run_until_complete(bench.akube.request("GET", one))
            assert sync_one == async_one, "the two clients disagree on one GET"
            # warm-up: every variant opens its connections
            for v in ("sync", "sync_pool32", "asyncio"):
                bench.sequential(v, 20, "GET", one)
                bench.concurrent(v, 4 * args.concurrency, lambda i: ("GET", one, None, "application/json"))
                bench.sequential(v, 1, "GET", LIST_PATH)

            all3 = ["sync", "asyncio", "sync_pool32"]
            two = ["sync", "asyncio"]
            res: dict[str, dict[str, list[float]]] = {}

            def add(name: str, variant: str, value: float) -> None:
                res.setdefault(name, {}).setdefault(variant, []).append(value)

            def patch(i: int) -> tuple[str, str, Any, str]:
                return ("PATCH", f"{CM_PATH}/p{i % args.concurrency}", {"data": {"n": str(i)}},
                        "application/merge-patch+json")

            for r in range(args.rounds):
                for v in _rotate(two, r):
                    wall, cpu, samples = bench.sequential(v, args.gets_c1, "GET", one)
                    add("get_c1_p50_ms", v, statistics.median(samples) * 1000)
                    add("get_c1_cpu_s_per_1000", v, cpu * 1000 / args.gets_c1)
                for v in _rotate(all3, r):
                    wall, cpu, _ = bench.concurrent(v, args.gets_c32, lambda i: ("GET", one, None, "application/json"))
                    add("get_c32_calls_per_s", v, args.gets_c32 / wall)
                    add("get_c32_cpu_s_per_1000", v, cpu * 1000 / args.gets_c32)
                for v in _rotate(all3, r):
                    wall, cpu, _ = bench.concurrent(v, args.patches, patch)
                    add("patch_c32_calls_per_s", v, args.patches / wall)
                    add("patch_c32_cpu_s_per_1000", v, cpu * 1000 / args.patches)
                for v in _rotate(two, r):
                    wall, cpu, _ = bench.sequential(v, args.lists, "GET", LIST_PATH)
                    add("list_s", v, wall / args.lists)
                    add("list_cpu_s", v, cpu / args.lists)
            measured_s = time.monotonic() - t - populate_s
        finally:
            bench.close()

        rss: dict[str, list[float]] = {}
        for r in range(3):
            for v in _rotate(two, r):
                got = rss_growth(v, kubeconfig)
                assert got["items"] == args.list_size, got
                rss.setdefault(v, []).append(got["peak"])
        res["list_rss_growth_mib"] = rss
    finally:
        plane.stop()

    c = args.concurrency
    rows = [{"bench": "kube_clients", "setup": {
        "rounds": args.rounds, "concurrency": c, "loop": args.loop, "gets_c1": args.gets_c1, "gets_c32": args.gets_c32,
        "patches": args.patches, "lists": args.lists, "list_size": args.list_size,
        "sync_default_pool": kubernetes.client.Configuration().connection_pool_maxsize,
        "populate_s": round(populate_s, 1), "measured_s": round(measured_s, 1),
        "total_s": round(time.monotonic() - started, 1)},
        "machine": {**info, "loadavg_end": round(os.getloadavg()[0], 2)}}]
    better = {"get_c1_p50_ms": "lower", "get_c1_cpu_s_per_1000": "lower", "get_c32_calls_per_s": "higher",
              "get_c32_cpu_s_per_1000": "lower", "patch_c32_calls_per_s": "higher",
              "patch_c32_cpu_s_per_1000": "lower", "list_s": "lower", "list_cpu_s": "lower",
              "list_rss_growth_mib": "lower"}
    digits = {"get_c32_calls_per_s": 1, "patch_c32_calls_per_s": 1, "list_rss_growth_mib": 1}
    rows += [figure(name, better[name], per_round, digits.get(name, 4)) for name, per_round in res.items()]
    meta = run_meta()  # one for the run: its rows share the date
    for row in rows:
        print(json.dumps(row), flush=True)
        record("kube-clients", row, results_dir=args.results_dir, meta=meta)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--gets-c1", type=int, default=300, help="sequential GETs per variant per round")
    parser.add_argument("--gets-c32", type=int, default=1500, help="concurrent GETs per variant per round")
    parser.add_argument("--patches", type=int, default=800, help="concurrent PATCHes per variant per round")
    parser.add_argument("--lists", type=int, default=5, help="LISTs per variant per round")
    parser.add_argument("--list-size", type=int, default=2000, help="ConfigMaps in the listed namespace")
    parser.add_argument("--loop", choices=["asyncio", "uvloop"], default="asyncio",
                        help="the event loop kubernetes_asyncio runs on (uvloop: as the gateway's server runs)")
    parser.add_argument("--rss-child", choices=["sync", "asyncio"], help=argparse.SUPPRESS)
    parser.add_argument("--kubeconfig", type=Path, help=argparse.SUPPRESS)
    add_results_dir(parser, "kube-clients-cpu.jsonl")
    args = parser.parse_args()
    if args.rss_child:
        rss_child(args.rss_child, args.kubeconfig)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
