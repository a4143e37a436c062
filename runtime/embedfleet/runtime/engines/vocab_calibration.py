"""Calibration inputs drawn from the model's own vocabulary: rare whole words, as queries and as passages
up to the model's maximum length.

The fixed calibration texts (calibration.json) are natural language of at most 128 tokens (MiniLM's). Users also
send keyword dumps, tags, lists and long passages of words with no context between them, and those are
where FP8 strays furthest from bf16: measured on all-MiniLM-L6-v2 over 2,000 held-out bench-corpus texts,
the cosine gap grows with length (mean 0.9977 under 10 tokens, 0.9918 at 200-256 tokens) and the worst
inputs were all 185-222-token runs of rare words, below every fixed text's minimum. A gate that never saw
such an input cannot speak for it.

The words come from the tokenizer itself, so this works for any tokenizer without a word list (the tests
run WordPiece and a byte-level BPE): vocabulary entries drawn with a fixed seed, kept when they decode to
letters only and encode back to the same single token (a whole word, not a piece). Vocabularies run
from frequent to rare, so a uniform draw over ids is mostly rare words. Passages are laid out on a ladder
of token lengths from a few tokens to `max_length`, with more at the top, where the measured tail is.
The same model always gets the same texts.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

SEED = 8191  # the generated set is part of the gate's definition: change it and verdicts may change
POOL_WORDS = 2048  # distinct words the passages draw from
MIN_WORDS = 64  # fewer whole words than this (a tiny vocabulary): other whole entries join them
SCAN_CHUNK = 4096  # vocabulary ids decoded and re-encoded per step while collecting words
MIN_LENGTH = 4
# passages per rung of the ladder, by divisor of max_length: the longest most often, as the tail is there
TOP_COUNTS = {1: 8, 2: 4}  # max_length itself, max_length // 2
SHORT_COUNT = 2  # each further halving down to MIN_LENGTH


def whole_words(tok: Tokenizer, limit: int = POOL_WORDS, seed: int = SEED) -> list[str]:
    """Up to `limit` vocabulary entries that are whole words of letters, in a seeded order.

    Where a vocabulary has too few of those (a tiny test tokenizer), any entry that decodes to visible
    text and encodes back to itself is used instead, so every model gets long inputs."""
    ids = list(range(tok.get_vocab_size()))
    random.Random(seed).shuffle(ids)
    words: list[str] = []
    fallback: list[str] = []
    for start in range(0, len(ids), SCAN_CHUNK):
        chunk = ids[start:start + SCAN_CHUNK]
        texts = tok.decode_batch([[i] for i in chunk])
        encoded = tok.encode_batch(texts, add_special_tokens=False)
        for i, text, enc in zip(chunk, texts, encoded, strict=True):
            word = text.strip()
            if not word or enc.ids != [i]:
                continue
            (words if word.isalpha() else fallback).append(word)
        if len(words) >= limit:
            return words[:limit]
    return words if len(words) >= MIN_WORDS else (words + fallback)[:limit]


def length_ladder(max_length: int) -> list[int]:
    """Token lengths of the generated passages, longest first: max_length 8 times, max_length // 2 four
    times, then every further halving down to MIN_LENGTH twice."""
    lengths: list[int] = []
    divisor = 1
    while max_length // divisor >= MIN_LENGTH:
        lengths += [max_length // divisor] * TOP_COUNTS.get(divisor, SHORT_COUNT)
        divisor *= 2
    return lengths


def vocabulary_texts(tokenizer_path: Path, max_length: int, seed: int = SEED) -> list[str]:
    """Passages of rare whole words at every length of `length_ladder(max_length)`.

    A passage of n words is about n tokens (each word is one token; special tokens add a few), so the
    longest reach `max_length` and are cut there by the gate's truncation, as a served input would be."""
    tok = Tokenizer.from_file(str(tokenizer_path))
    tok.no_truncation()
    tok.no_padding()
    pool = whole_words(tok, seed=seed)
    if not pool:
        return []
    rng = random.Random(seed + 1)
    return [" ".join(rng.choice(pool) for _ in range(n)) for n in length_ladder(max_length)]
