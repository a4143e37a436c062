"""Embedding-aware rollouts: revisions and the drift gate (revisions.py, with probe_client.py reading the
revisions' probes from their pods), hub waves (waves.py) and probe drift monitoring (drift.py). Decisions
are pure functions; the handlers and the hub controller call them."""
