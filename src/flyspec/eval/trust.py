"""Trust metrics: did a method change what plain decoding's output *says*, or loop where it did not?

Both compare one method output with plain decoding's output for the same prompt (same model,
same dtype, greedy), need no reference answer, and are pure functions of the texts / token ids.
A lossless method's output equals plain decoding's, so it scores False on both; on plain
decoding's own records they are False by definition (it is compared with itself).

meaning change
    The two outputs differ in their **numbers** or their **identifiers**.

    *Numbers* are found by ``NUMBER``: digit runs with an optional sign (only where the ``-`` does
    not follow a letter or digit, so ``2023-11-30`` is 2023, 11, 30), thousands groups and
    dotted parts (``v2.14.3`` is ``2.14.3``). They are normalized — commas dropped, a single
    decimal point compared as a decimal (``1,000`` = ``1000``, ``2.50`` = ``2.5``, ``07`` = ``7``),
    several dots kept as written — and compared as **multisets**: saying a number twice where
    plain said it once counts, the order does not.

    *Identifiers* are compared as **sets** of the words that look like code or names:

    - a word (letters, digits, ``_``, inner ``-``) with a ``_`` (``user_id``), with both a letter
      and a digit (``x1``, ``SN-880418``), or with an inner capital (``camelCase``, ``HTTPServer``);
    - every identifier-shaped word inside ```` `backticks` ```` or a fenced code block;
    - a capitalised word of two or more letters that also occurs in the prompt (a name the output
      copies: ``Maria``, ``Lisbon``, ``SELECT``), unless it is one of ``COMMON_CAPITALISED`` —
      words that open sentences ("The", "It", "Write"), so "The capital is" and "Its capital is"
      are the same. A name that is also a common word ("Will") is missed.

    Prose paraphrase changes neither set; a changed digit, a renamed variable, a swapped or
    dropped name does. The result says what differed (:class:`MeaningChange`), for the diffs.
    When an output was cut by the token limit its last word is ignored (it may be cut mid-number:
    ``12`` of ``1234``). Outputs that phrase the same answer at different lengths can still differ
    near the limit; the synthetic tasks' answers are short enough to finish.

loop
    The method's output has a token n-gram that occurs ``LOOP_MIN_COUNT`` times or more in it and
    at most once in plain decoding's output. With ``LOOP_NGRAM = 8`` and ``LOOP_MIN_COUNT = 3``
    (occurrences may overlap):

    - a loop of period ``p`` tokens is caught after ``8 + 2p`` tokens: 12 for ``1.1.1.1…`` (period
      2), about 30 for a 10-token code line written over and over;
    - a list whose lines share up to 7 fixed tokens around a changing number or word
      (``1. Red`` / ``2. Green``; ``x is 1`` / ``x is 2``) has no repeated 8-gram, so it is not a loop;
    - a phrase said twice (restating the question, then answering) needs a third time;
    - "at most once in plain's output", not "fewer than 3 times": when plain decoding loops on the
      same cycle (an output that repeats because the prompt asks for it, or a model that loops by
      itself) its loop, wherever it starts or is cut, holds every 8-token rotation of the cycle at
      least twice, so the method is not blamed for it; and a phrase plain decoding says twice is
      not a loop the method made by saying it three times.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

LOOP_NGRAM = 8
LOOP_MIN_COUNT = 3

# A number: sign only where "-" does not follow a letter or digit; thousands groups; dotted parts.
NUMBER = re.compile(r"(?:(?<![\w.])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)*")
_WORD = re.compile(r"\w+(?:-\w+)*")
_CODE_SPAN = re.compile(r"```.*?(?:```|\Z)|`[^`\n]+`", re.DOTALL)
_CODE_WORD = re.compile(r"[A-Za-z_]\w*")
_INNER_CAPITAL = re.compile(r"[a-z][A-Z]|[A-Z]{2}[a-z]")

# Capitalised words that open sentences or instructions: not names even when the prompt has them.
COMMON_CAPITALISED = frozenset((
    "The", "A", "An", "It", "Its", "This", "That", "These", "Those", "There", "Here", "He", "She", "They", "We",
    "You", "Your", "My", "Our", "His", "Her", "Their", "Them", "In", "On", "At", "For", "To", "Of", "And", "But",
    "Or", "So", "If", "When", "Then", "What", "Which", "Who", "Whom", "Whose", "Where", "Why", "How", "As", "By",
    "With", "From", "Into", "About", "After", "Before", "Also", "Each", "Every", "All", "Some", "Any", "No",
    "Not", "Yes", "Is", "Are", "Was", "Were", "Be", "Been", "Do", "Does", "Did", "Can", "Could", "Will", "Would",
    "Should", "May", "Might", "Must", "Please", "Answer", "Reply", "Write", "Give", "Describe", "Explain",
    "Repeat", "Copy", "Change", "Rename", "Convert", "List", "Count", "Name", "Spell", "Turn", "Add", "Use",
    "Find", "Make", "Let", "Note", "Sure", "Okay", "OK", "Hi", "Hello", "Question", "Example", "First", "Second",
    "Third", "Last", "One", "Two", "Three", "Four", "Five", "True", "False", "None",
))  # fmt: skip


@dataclass(frozen=True)
class MeaningChange:
    """What differs between a method's output and plain decoding's (empty tuples: nothing)."""

    numbers_added: tuple[str, ...] = ()  # in the method's output more often than in plain's
    numbers_removed: tuple[str, ...] = ()
    identifiers_added: tuple[str, ...] = ()  # in the method's output only
    identifiers_removed: tuple[str, ...] = ()  # in plain's output only

    @property
    def changed(self) -> bool:
        return bool(self.numbers_added or self.numbers_removed or self.identifiers_added or self.identifiers_removed)

    def to_dict(self) -> dict[str, Any]:
        return {key: list(value) for key, value in asdict(self).items()}


def normalize_number(text: str) -> str:
    """``"1,000"`` → ``"1000"``, ``"2.50"`` → ``"2.5"``, ``"-07"`` → ``"-7"``; ``"2.14.3"`` stays as it is."""
    plain = text.replace(",", "")
    if plain.count(".") > 1:
        return plain
    try:
        value = Decimal(plain).normalize()
    except InvalidOperation:  # pragma: no cover - NUMBER only matches digits
        return plain
    return format(value + 0, "f")  # + 0 turns -0 into 0


def numbers(text: str) -> Counter[str]:
    """The normalized numbers of a text, with their counts."""
    return Counter(normalize_number(found) for found in NUMBER.findall(text))


def _looks_like_code(word: str) -> bool:
    has_letter = any(char.isalpha() for char in word)
    has_digit = any(char.isdigit() for char in word)
    return ("_" in word and has_letter) or (has_letter and has_digit) or bool(_INNER_CAPITAL.search(word))


def identifiers(text: str, prompt: str) -> set[str]:
    """Identifier-like words of ``text`` and the prompt's capitalised words it repeats (see the module doc)."""
    found = {word for span in _CODE_SPAN.findall(text) for word in _CODE_WORD.findall(span)}
    prompt_words = set(_WORD.findall(prompt)) | set(re.findall(r"\w+", prompt))  # "Reilly-Nakamura", "Nakamura"
    for word in _WORD.findall(text):
        is_name = word[0].isupper() and len(word) > 1 and word in prompt_words and word not in COMMON_CAPITALISED
        if is_name or _looks_like_code(word):
            found.add(word)
    return found


def _drop_last_word(text: str) -> str:
    """The text without its last word: what an output cut by the token limit surely contains."""
    return re.sub(r"\S+\s*$", "", text)


def meaning_change(
    method_text: str,
    plain_text: str,
    prompt: str,
    *,
    method_truncated: bool = False,
    plain_truncated: bool = False,
) -> MeaningChange:
    """The numbers (multisets) and identifiers (sets) in which the two outputs differ.

    ``*_truncated``: that output stopped at the token limit, so its last word is ignored.
    """
    method = _drop_last_word(method_text) if method_truncated else method_text
    plain = _drop_last_word(plain_text) if plain_truncated else plain_text
    method_numbers, plain_numbers = numbers(method), numbers(plain)
    method_identifiers, plain_identifiers = identifiers(method, prompt), identifiers(plain, prompt)
    return MeaningChange(
        numbers_added=tuple(sorted((method_numbers - plain_numbers).elements())),
        numbers_removed=tuple(sorted((plain_numbers - method_numbers).elements())),
        identifiers_added=tuple(sorted(method_identifiers - plain_identifiers)),
        identifiers_removed=tuple(sorted(plain_identifiers - method_identifiers)),
    )


def ngram_counts(token_ids: list[int], n: int = LOOP_NGRAM) -> Counter[tuple[int, ...]]:
    """How often each token n-gram occurs (overlapping occurrences count)."""
    return Counter(tuple(token_ids[start : start + n]) for start in range(len(token_ids) - n + 1))


def repeated_ngrams(token_ids: list[int], n: int = LOOP_NGRAM, min_count: int = LOOP_MIN_COUNT) -> set[tuple[int, ...]]:
    """The token n-grams that occur at least ``min_count`` times (overlapping occurrences count)."""
    return {ngram for ngram, count in ngram_counts(token_ids, n).items() if count >= min_count}


def new_loop(
    method_ids: list[int], plain_ids: list[int], n: int = LOOP_NGRAM, min_count: int = LOOP_MIN_COUNT
) -> tuple[int, ...] | None:
    """The first (by position) n-gram the method repeats ``min_count`` times and plain decoding at most once.

    None: no new loop.
    """
    repeated = repeated_ngrams(method_ids, n, min_count)
    plain_counts = ngram_counts(plain_ids, n)
    for start in range(len(method_ids) - n + 1):
        ngram = tuple(method_ids[start : start + n])
        if ngram in repeated and plain_counts[ngram] <= 1:
            return ngram
    return None
