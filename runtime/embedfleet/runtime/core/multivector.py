"""ColBERT's query and document markers, query expansion and skiplist, as pure functions over token ids.

PyLate (models/colbert.py) inserts a marker token right after the first token ([CLS]): its
`query_prefix` for queries, `document_prefix` for documents. Queries are then padded to `query_length`
with [MASK] tokens (query augmentation), which the other tokens do not attend to unless the config says
`attend_to_expansion_tokens`; their output vectors are kept. Documents lose the vectors of skiplist
tokens (punctuation, in PyLate's default) after encoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from embedfleet.runtime.core.tokenize import Tokenized


@dataclass(frozen=True, slots=True)
class Marked:
    """An engine input with ColBERT's markers. `attended`: how many leading tokens are attended
    (None: all); the rest are expansion [MASK] tokens, encoded but not attended to."""

    ids: list[int]
    truncated: bool = False
    attended: int | None = None
    type_ids: list[int] | None = None

    def __len__(self) -> int:
        return len(self.ids)


def mark(tok: Tokenized, marker: int | None, expand_to: int = 0, mask_id: int | None = None,
         attend_expansion: bool = False) -> Marked:
    """Insert `marker` after the first token; pad with `mask_id` up to `expand_to` tokens (queries)."""
    ids = list(tok.ids)
    if marker is not None:
        ids = [*ids[:1], marker, *ids[1:]]
    attended = None
    if expand_to and mask_id is not None and len(ids) < expand_to:
        attended = None if attend_expansion else len(ids)
        ids += [mask_id] * (expand_to - len(ids))
    return Marked(ids, tok.truncated, attended)


def drop_skiplist(vectors: np.ndarray, ids: list[int], skip: frozenset[int]) -> np.ndarray:
    """A document's vectors without those of skiplist tokens (PyLate drops them after encoding)."""
    if not skip:
        return vectors
    keep = [i for i, t in enumerate(ids) if t not in skip]
    return vectors if len(keep) == len(ids) else vectors[keep]
