"""The control-plane kit: what every embedfleet component that watches Kubernetes shares.

One API client library (the official, synchronous ``kubernetes`` package, its calls on worker threads: the
operator's kopf handlers are synchronous already, and the gateway keeps the API server off its event loop),
raw calls by URL (`client.py`), and informers (`informer.py`: list + watch with bookmarks, resumed from the
newest version, a relist on 410, back-off, a stall bound, a restart hook for metrics). The hub, the
gateway and the operator's leader election use these; nothing here imports a component.

Why this client and not an asyncio-native one (``kubernetes_asyncio``): measured, not assumed.
``python bench/kube_clients.py`` (after ``pip install kubernetes_asyncio``, for the bench only) drives both by raw URL
on one real kube-apiserver, interleaved, medians of 7 rounds. On 2 cores (AMD EPYC; three runs, the third with
kubernetes_asyncio on uvloop), kubernetes_asyncio ÷ this client: one GET at a time 1.26-1.54x the p50 latency
and 1.68-2.00x the CPU per call; 32 GETs in flight (32 threads over one ApiClient vs 32 coroutines over one)
0.88-1.01x the calls/s at 0.93-1.01x the CPU per call; 32 merge PATCHes in flight 1.03-1.15x the calls/s at
0.82-1.01x the CPU; a LIST of 2,000 ConfigMaps 1.00-1.05x the time, 0.86-0.95x the CPU, 1.07x the RSS growth
(8.2 vs 7.7 MiB). No clear win on CPU or throughput (at most a 15% edge on concurrent writes, within the
spread between runs) and a loss at concurrency 1, the way the operator's handlers and the hub's writer make
their calls: the kit stays synchronous. Switching would take async twins of ``KubeClient``, ``Informer`` and
the work queue, and coroutine callers (kopf's async handlers, the hub's rounds, the gateway's watches on its
event loop). Figures: docs/performance.md, bench/results/kube-clients-cpu.jsonl.
"""
