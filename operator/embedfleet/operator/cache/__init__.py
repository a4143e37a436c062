"""Node-local model weight cache: ``embedfleet cache pull`` fills ``<cache-dir>/sha256-<hex>/`` with
verified weights so a new replica loads from local disk; ``embedfleet cache digest`` computes the key.

See docs/cache.md for the digest definition and the on-disk layout.
"""
