"""Request classes: interactive (queries) before bulk work, as the runtime orders them.

A request is bulk when its client says so (`X-Priority: bulk`, the runtime's header) or when it
carries more inputs than --urgent-max-inputs (4, the runtime's default), counted from the body the
gateway already parses for `model`. Held requests are released interactive first, then in arrival
order (hold.py); a bulk request is judged against the bulk bound when shedding (shed.py).
"""

from __future__ import annotations

from typing import Any

URGENT_MAX_INPUTS = 4
INPUT_FIELDS = ("input", "inputs", "texts", "documents")  # OpenAI, TEI, Cohere-style embed, rerank


def input_count(doc: Any) -> int:
    """How many inputs a request body carries (1 when it is one text or one token list)."""
    if not isinstance(doc, dict):
        return 1
    for name in INPUT_FIELDS:
        value = doc.get(name)
        if isinstance(value, list):
            if value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return 1  # one input given as token ids
            return len(value)
        if value is not None:
            return 1
    return 1


def is_bulk(priority_header: str | None, inputs: int, urgent_max_inputs: int = URGENT_MAX_INPUTS) -> bool:
    """`X-Priority: bulk` (any other value changes nothing, as in the runtime), or more than
    `urgent_max_inputs` inputs."""
    if priority_header is not None and priority_header.strip().lower() == "bulk":
        return True
    return inputs > urgent_max_inputs
