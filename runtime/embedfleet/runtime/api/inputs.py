"""Checks on request inputs that a JSON schema cannot express; each failure names the input."""

from __future__ import annotations

from embedfleet.runtime.api.errors import ApiError


def as_batch(raw: str | list, max_client_batch: int, vocab_size: int) -> list[str] | list[list[int]]:
    """Normalise `input`/`inputs` to a list of texts or a list of token-id lists."""
    if isinstance(raw, str):
        batch: list = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        batch = [raw]
    else:
        batch = raw
    if not batch:
        raise ApiError(422, "input must not be empty: send at least one text", "empty_input")
    if len(batch) > max_client_batch:
        raise ApiError(413, f"batch of {len(batch)} inputs is over the limit of {max_client_batch} per request "
                       "(--max-client-batch-size); split it", "batch_too_large")
    if all(isinstance(item, str) for item in batch):  # texts, the common case: one pass, the blank one found after
        if not all(map(str.strip, batch)):
            i = next(i for i, item in enumerate(batch) if not item.strip())
            raise ApiError(422, f"input {i} is empty or whitespace only", "empty_input")
        return batch
    for i, item in enumerate(batch):
        if isinstance(item, str):
            if not item.strip():
                raise ApiError(422, f"input {i} is empty or whitespace only", "empty_input")
        else:
            if not item:
                raise ApiError(422, f"input {i} is an empty token list", "empty_input")
            bad = next((t for t in item if t >= vocab_size), None)
            if bad is not None:
                raise ApiError(422, f"input {i} has token id {bad}, outside the vocabulary of {vocab_size}",
                               "invalid_token")
    kinds = {isinstance(item, str) for item in batch}
    if len(kinds) > 1:
        raise ApiError(422, "input mixes texts and token lists; send one kind per request", "mixed_input")
    return batch
