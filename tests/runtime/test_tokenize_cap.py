"""/tokenize's token cap, at the tokenizer pool: the answer is refused before it is built, with both counts."""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.runtime.core.tokenize import TokenizerPool, TooManyTokens
from embedfleet.runtime.models.spec import load_spec
from embedfleet.runtime.settings import default_model_dir


@pytest.fixture(scope="module")
def pool() -> TokenizerPool:
    pool = TokenizerPool(load_spec(default_model_dir()).path / "tokenizer.json", 1)
    yield pool
    pool.close()


def test_within_the_cap_every_token_is_listed(pool: TokenizerPool) -> None:
    tokens = asyncio.run(pool.details(["hello world", "again"], max_tokens=7))
    assert [len(t) for t in tokens] == [4, 3]  # [CLS] hello world [SEP], [CLS] again [SEP]: 7 exactly


def test_over_the_cap_is_refused_with_the_counts(pool: TokenizerPool) -> None:
    with pytest.raises(TooManyTokens, match="10 tokens in all, more than the limit of 7") as caught:
        asyncio.run(pool.details(["hello world", "again", "x"], max_tokens=7))
    assert (caught.value.tokens, caught.value.limit) == (10, 7)


def test_no_cap_keeps_the_old_behaviour(pool: TokenizerPool) -> None:
    assert len(asyncio.run(pool.details(["word " * 3000]))[0]) > 3000
