"""`embedfleet serve --fronts N`: the server split into processes, so that HTTP, validation, tokenization and
response encoding use the machine's cores while one engine process per pod keeps the batching.

    supervisor (supervisor.py)    holds the listening socket, starts and restarts the others
    ├── engine (engine_side.py)   the models, the batch managers and admission: one decision per pod;
    │                             the full application on a private Unix socket for the routes fronts proxy
    └── front x N (front_side.py) HTTP on the shared socket: parse, tokenize, encode; token ids to the
                                  engine and vectors back over link.py's frames

Everything a request relies on stays one decision per pod because it is taken in the engine process, where
it was before: admission by expected wait, deadlines, tenant quotas and priorities, preemption. Fronts see
the engine's load in snapshots it pushes, which only let them refuse early (the gate's 429 before reading a
body) and answer /ready and /load; the engine still judges every request. Metrics are Prometheus's
multiprocess mode: each process writes its own files, and /metrics (served by the engine) adds them up.
"""
