"""Spoke side of the fleet: the heartbeat lease the hub reads (the spoke never needs the hub's credentials)."""
