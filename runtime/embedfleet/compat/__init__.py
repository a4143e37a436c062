"""Vector compatibility, shared by the runtime, the operator, the hub and the gateway: the canonical probe set,
the drift gate that compares two revisions' probe outputs, revision identity and the `name@rN` names.

It lives outside embedfleet.runtime so the operator and the gateway import it without the runtime package.

A package of the small common package (the top-level ``embedfleet.*`` modules: otel, calls, httpserver,
compat, api_group), shared by components: its modules must import nothing from embedfleet.runtime,
.operator, .gateway or .client (tests/packaging/test_boundaries.py checks).
"""
