"""Is this failure the replica running out of memory? Shared by the sync routes (503) and the async
worker (a transient failure, retried), which must agree on it."""

from __future__ import annotations

OOM_MESSAGES = ("out of memory", "can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA OOM (`torch.OutOfMemoryError`, a RuntimeError) or a host allocation that failed.

    Matched by message as well as by type because torch raises plain RuntimeErrors for OOM from
    some kernels (cuBLAS, the CPU allocator), and importing torch here would tie this module to it.
    """
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc).lower() for m in OOM_MESSAGES)
