"""HTTP layer: routes, request/response schemas, errors. Knows nothing of how batches are built."""
