"""The hub: inventory health, global placement, propagation to spokes and aggregation of their status.

``health``, ``convert`` and ``autoscale`` are pure; ``loop`` does the I/O of one scheduling round; ``handlers``
is the kopf glue that runs the loop for as long as the hub operator runs.
"""
