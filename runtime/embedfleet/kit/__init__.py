"""The control-plane kit: what every embedfleet component that watches Kubernetes shares.

One API client library (the official, synchronous ``kubernetes`` package, its calls on worker threads: the
operator's kopf handlers are synchronous already, and the gateway keeps the API server off its event loop),
raw calls by URL (`client.py`), and informers (`informer.py`: list + watch with bookmarks, resumed from the
newest version, a relist on 410, back-off, a stall bound, a restart hook for metrics). The hub, the
gateway and the operator's leader election use these; nothing here imports a component.
"""
