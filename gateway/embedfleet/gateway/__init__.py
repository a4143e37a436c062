"""embedfleet gateway: one front door for a fleet of runtimes, routing each request by its model.

`embedfleet gateway --upstream NAME=URL ...` runs it. Data flows one way: proxy (HTTP in, HTTP out)
-> fleet (which deployment, hold or go) -> pick (which replica) ; upstreams keep each replica's
state from a cheap poll and from the answers themselves. It imports neither torch nor the runtime.
"""
