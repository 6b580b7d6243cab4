"""Incremental detokenisation: the stopper's text after every step equals decoding the whole output."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from conftest import CORPUS, make_tokenizer
from flyspec.decoding.stopping import Stopper


@pytest.mark.parametrize("seed", range(6))
def test_stopper_text_equals_a_full_decode_after_every_commit(seed: int) -> None:
    tokenizer = make_tokenizer()
    rng = random.Random(seed)
    # real text (merges, spaces before punctuation) mixed with random ids (split UTF-8 bytes, specials)
    ids = tokenizer(" ".join(CORPUS[:4]) + " don 't , ok .", add_special_tokens=False)["input_ids"]
    ids = [token if rng.random() < 0.7 else rng.randrange(len(tokenizer)) for token in ids]
    stopper = Stopper(tokenizer, frozenset(), max_new_tokens=len(ids))
    position = 0
    while position < len(ids):
        size = rng.randint(1, 6)
        stopper.commit(ids[position : position + size])
        position += size
        assert stopper.text() == tokenizer.decode(stopper.generated, skip_special_tokens=True)


def test_multibyte_characters_split_over_tokens_decode_when_complete() -> None:
    tokenizer: PreTrainedTokenizerFast = make_tokenizer()
    ids = tokenizer("naïve café 東京 🚀 done", add_special_tokens=False)["input_ids"]
    stopper = Stopper(tokenizer, frozenset(), max_new_tokens=len(ids))
    for token in ids:
        stopper.commit([token])
        assert stopper.text() == tokenizer.decode(stopper.generated, skip_special_tokens=True)
    assert stopper.text() == "naïve café 東京 🚀 done"
