"""A retrieval set of real English prose found on any machine with Python: the docstrings of the standard
library and the installed packages, read with ``ast`` (nothing is imported or downloaded).

Passages are docstring paragraphs of at least 15 words; queries are docstring summary lines whose own body
paragraph is in the index (a summary -> its explanation, the way a user's question meets a help page).
Unlike ``_common.corpus`` (random vocabulary, whose ranks past the first are near-ties), neighbours here are
related text at realistic distances, so a top-10 overlap measured on it says what retrieval would see.

The set depends on the packages installed (the bench reports how many files it read); two machines with
the same lock file get the same passages, because files are walked in sorted order and ties are broken by
a hash of the text, not by the process's hash seed.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sysconfig
from pathlib import Path

MIN_WORDS = 15
MAX_WORDS = 160
SKIP_DIRS = {"test", "tests", "testing", "__pycache__", "idlelib", "lib2to3", "_vendor"}


def _roots() -> list[Path]:
    paths = sysconfig.get_paths()
    return [Path(p) for p in dict.fromkeys((paths["stdlib"], paths["purelib"], paths["platlib"]))]


def _sources(roots: list[Path]) -> list[Path]:
    out: list[Path] = []
    seen: set[Path] = set()
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".dist-info"))
            if root == Path(sysconfig.get_paths()["stdlib"]) and "site-packages" in dirnames:
                dirnames.remove("site-packages")
            for name in sorted(filenames):
                path = here / name
                if name.endswith(".py") and path not in seen:
                    seen.add(path)
                    out.append(path)
    return out


def _key(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def _is_prose(paragraph: str) -> bool:
    """Sentences, not doctests, parameter tables or code: most words alphabetic, no prompts or rulers."""
    if ">>>" in paragraph or "----" in paragraph or "====" in paragraph or "::" in paragraph:
        return False
    words = paragraph.split()
    return sum(w.strip(".,;:()'\"").isalpha() for w in words) >= 0.7 * len(words)


def docstring_pairs(limit_files: int | None = None) -> tuple[list[tuple[str, list[str]]], int]:
    """(summary line, body paragraphs) for every docstring with both; and how many files were read."""
    pairs: list[tuple[str, list[str]]] = []
    files = _sources(_roots())[:limit_files]
    for path in files:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Module)):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            head, *rest = [" ".join(p.split()) for p in doc.strip().split("\n\n")]
            body = [p for p in rest if MIN_WORDS <= len(p.split()) <= MAX_WORDS and _is_prose(p)]
            if len(head.split()) >= 4 and body:
                pairs.append((head, body))
    return pairs, len(files)


def retrieval_set(passages: int, queries: int) -> dict[str, object]:
    """``passages`` distinct paragraphs and ``queries`` summary lines, each with the index of its own first
    body paragraph (the query's relevant passage). Deterministic for a given set of installed files."""
    pairs, files = docstring_pairs()
    # One query candidate per distinct summary; its first body paragraph is its answer.
    by_head: dict[str, str] = {}
    every: dict[str, None] = {}
    for head, body in pairs:
        by_head.setdefault(head, body[0])
        for paragraph in body:
            every.setdefault(paragraph, None)
    ranked = sorted(every, key=_key)
    candidates = sorted(by_head.items(), key=lambda kv: _key(kv[0]))[:queries]
    answers = [a for _, a in candidates]
    index = list(dict.fromkeys(answers + ranked))[:passages]
    position = {p: i for i, p in enumerate(index)}
    query_texts = [h for h, a in candidates if a in position]
    sources = [position[a] for h, a in candidates if a in position]
    order = sorted(range(len(index)), key=lambda i: _key(index[i]))  # answers not all at the front
    remap = {old: new for new, old in enumerate(order)}
    return {"passages": [index[i] for i in order], "queries": query_texts,
            "sources": [remap[s] for s in sources], "files": files, "distinct_paragraphs": len(every)}


if __name__ == "__main__":
    got = retrieval_set(10_000, 200)
    print({k: (len(v) if isinstance(v, list) else v) for k, v in got.items()})
    for q, s in list(zip(got["queries"], got["sources"], strict=True))[:3]:  # type: ignore[call-overload]
        print(repr(q), "->", got["passages"][s][:120])  # type: ignore[index]
