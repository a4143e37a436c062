"""Embedding-aware rollouts: revisions and the drift gate (revisions.py), hub waves (waves.py) and probe drift
monitoring (drift.py). Decisions are pure functions; the handlers and the hub loop call them."""
