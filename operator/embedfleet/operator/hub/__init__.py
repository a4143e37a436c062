"""The hub: inventory health, global placement, propagation to spokes and aggregation of their status.

``health``, ``convert`` and ``autoscale`` are pure; ``controller`` runs the reconcilers (clusters,
placement, policies) on the kit's work queue; ``handlers`` is the kopf glue that runs the controller for as
long as the hub operator runs.
"""
