"""The canonical probe set shipped with the runtime: fixed texts whose outputs fingerprint a revision.

Changing the file changes every fingerprint, so its `version` is part of every probe answer and a gate
refuses to compare outputs of two different versions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

PATH = Path(__file__).with_name("probe_set.json")


@dataclass(frozen=True)
class RerankProbe:
    query: str
    documents: tuple[str, ...]


@dataclass(frozen=True)
class ProbeSet:
    version: str
    texts: tuple[str, ...]
    rerank: tuple[RerankProbe, ...]

    def pairs(self) -> list[tuple[str, str]]:
        """Every (query, document) pair of the rerank probes, query by query (rerankers score these)."""
        return [(probe.query, doc) for probe in self.rerank for doc in probe.documents]


@lru_cache(maxsize=1)
def load() -> ProbeSet:
    raw = json.loads(PATH.read_text(encoding="utf-8"))
    texts = tuple(raw["texts"])
    rerank = tuple(RerankProbe(r["query"], tuple(texts[i] for i in r["documents"])) for r in raw["rerank"])
    return ProbeSet(raw["version"], texts, rerank)
