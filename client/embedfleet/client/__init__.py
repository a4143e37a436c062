"""embedfleet.client: a fast, resilient client for embedding fleets, and the `embedfleet embed` backfill.

from embedfleet.client import Client
with Client(["http://eu:8080", "http://us:8080"]) as c:
    vectors = c.embed(["first text", "second text"])   # numpy (2, dim), input order
"""

from .aio import AsyncClient
from .decode import Usage
from .errors import (
    BatchFailedError,
    ClientError,
    DeadlineExceeded,
    FailedBatch,
    InputError,
    ResponseMismatchError,
    ServerError,
    TransportError,
)
from .results import BatchTiming, CallStats, EmbedResult, Label, RerankHit
from .retry import RetryPolicy
from .sync import Client

__all__ = [
    "AsyncClient",
    "BatchFailedError",
    "BatchTiming",
    "CallStats",
    "Client",
    "ClientError",
    "DeadlineExceeded",
    "EmbedResult",
    "FailedBatch",
    "InputError",
    "Label",
    "RerankHit",
    "ResponseMismatchError",
    "RetryPolicy",
    "ServerError",
    "TransportError",
    "Usage",
]
