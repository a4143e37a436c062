"""README and docs/ are for users and contributors: they describe the software, never how it was developed
(no session or issue numbers, no history of attempts, no commit hashes, no files outside the repository).
History belongs in CHANGELOG.md."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs.docfiles import ROOT, doc_files

PROCESS = [
    (re.compile(r"\bsessions?\s+\d+", re.I), "a session number"),
    (re.compile(r"\bsession's\b|\bthis session\b|\bearlier sessions?\b|\bother sessions'?", re.I), "a session"),
    (re.compile(r"\bissues?\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"\btried and not kept\b|\bnot kept\b", re.I), "a history of attempts"),
    (re.compile(r"\bturn\s+\d+", re.I), "a turn number"),
    (re.compile(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w-])"), "a commit hash"),
    (re.compile(r"\.\./shared/|/work/|DESIGN\.md|REALNODE\.md|STYLE\.md"), "a file outside the repository"),
]


@pytest.mark.parametrize("doc", doc_files(), ids=[str(p.relative_to(ROOT)) for p in doc_files()])
def test_the_docs_speak_of_the_software(doc: Path) -> None:
    found = []
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        for pattern, what in PROCESS:
            m = pattern.search(line)
            if m and not re.fullmatch(r"\d{7,}", m.group(0)):  # a long plain number is a figure, not a hash
                found.append(f"{doc.relative_to(ROOT)}:{number}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)
