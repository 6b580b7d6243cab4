"""Per-item task metrics. Every score is in [0, 1] (chrF, BLEU are sacrebleu's 0-100 divided by 100)."""

from __future__ import annotations

import json
import re
import string
from decimal import Decimal, InvalidOperation
from difflib import SequenceMatcher
from typing import Any

from flyspec.eval.safety import refusal

# A number: optional sign, thousands groups or plain digits, optional decimals.
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_ANSWER_MARKERS = (re.compile(r"####"), re.compile(r"answer is", re.IGNORECASE), re.compile(r"\\boxed\{"))
_CODE_BLOCK = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def normalize_number(text: str) -> Decimal | None:
    """``"$1,234.50"`` → ``Decimal("1234.50")``; commas, ``$`` and a trailing ``.`` are dropped."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        return Decimal(cleaned)
    except InvalidOperation:
        return None


def parse_final_number(text: str) -> Decimal | None:
    """The model's final numeric answer.

    After the last answer marker (``####``, "answer is", ``\\boxed{``) the first number there;
    without a marker, the last number in the text. ``None`` when there is no number.
    """
    for marker in _ANSWER_MARKERS:
        matches = list(marker.finditer(text))
        if matches:
            found = _NUMBER.search(text, matches[-1].end())
            if found:
                return normalize_number(found.group())
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def numeric_match(output: str, reference: str) -> float:
    """1.0 when the parsed final number equals the reference number (``1.50 == 1.5``)."""
    predicted, expected = parse_final_number(output), normalize_number(reference)
    return float(predicted is not None and expected is not None and predicted == expected)


def normalize_answer(text: str) -> str:
    """SQuAD-style: lower case, no punctuation, no articles, single spaces."""
    text = "".join(char for char in text.lower() if char not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def flatten_answers(reference: Any) -> list[str]:
    """Spec-Bench nests acceptable answers (``[["a", "b"]]``); a custom task may give a string."""
    if isinstance(reference, str):
        return [reference]
    answers: list[str] = []
    for entry in reference or []:
        answers.extend(flatten_answers(entry))
    return answers


def contains_answer(output: str, reference: Any) -> float:
    """1.0 when any acceptable answer occurs (normalized) in the output."""
    normalized = f" {normalize_answer(output)} "
    answers = [normalize_answer(answer) for answer in flatten_answers(reference)]
    return float(any(answer and f" {answer} " in normalized for answer in answers))


def exact_answer(output: str, reference: Any) -> float:
    normalized = normalize_answer(output)
    return float(any(normalized == normalize_answer(answer) for answer in flatten_answers(reference)))


def chrf(output: str, reference: Any) -> float:
    import sacrebleu  # heavy, only for translation

    return sacrebleu.sentence_chrf(output, flatten_answers(reference)).score / 100


def bleu(output: str, reference: Any) -> float:
    import sacrebleu

    return sacrebleu.sentence_bleu(output, flatten_answers(reference)).score / 100


def rouge_l(output: str, reference: Any) -> float:
    """ROUGE-L F1 against the reference (the best one when there are several)."""
    from rouge_score import rouge_scorer

    # made per call, not cached process-wide: it costs ~0.05 ms, less than one score
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    return max(scorer.score(answer, output)["rougeL"].fmeasure for answer in flatten_answers(reference))


_WORD = re.compile(r"\w+")


def _words(text: str) -> list[str]:
    """Lower-cased runs of letters, digits and ``_``: ``"k.nair1@example.com"`` → ``k, nair1, example, com``."""
    return [word.lower() for word in _WORD.findall(text)]


def _first_position(words: list[str], candidate: list[str]) -> int | None:
    """Where ``candidate`` first occurs in ``words`` as a contiguous run, or None."""
    if not candidate:
        return None
    for start in range(len(words) - len(candidate) + 1):
        if words[start : start + len(candidate)] == candidate:
            return start
    return None


def value_match(output: str, reference: Any, distractors: list[str] | tuple[str, ...] = ()) -> float:
    """1.0 when the output names an acceptable answer before any of ``distractors``.

    Texts compare as sequences of words (runs of letters, digits, ``_``; lower case), so
    punctuation and spacing around a value do not matter (``2019/03/14`` = ``2019-03-14``,
    ```` `load_page` ```` = ``load_page``) but every letter and digit does. ``distractors`` are the
    prompt's other values (a record's other fields, a story's other names and numbers): the answer
    is the candidate the output names *first*, so "The city is Lisbon, not Porto" is right and
    copying the whole record back is right only when the asked field came first. Without
    distractors this is ``contains`` on word sequences.
    """
    words = _words(output)
    answers = [_words(answer) for answer in flatten_answers(reference)]

    def mention(candidate: list[str]) -> tuple[int, int] | None:
        """Sorts by position, then longer first: at one start "Maria Lopez" beats "Maria"."""
        position = _first_position(words, candidate)
        return None if position is None else (position, -len(candidate))

    answer_mentions = [found for found in map(mention, answers) if found is not None]
    if not answer_mentions:
        return 0.0
    candidates = [_words(distractor) for distractor in distractors]
    other_mentions = [found for c in candidates if c not in answers and (found := mention(c)) is not None]
    return float(not other_mentions or min(answer_mentions) < min(other_mentions))


# Numbers in a list: no thousands groups ("412,87" is two numbers).
_LIST_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?")


def number_list_match(output: str, reference: Any) -> float:
    """1.0 when the output's numbers, in order, are exactly the reference's (``2.50`` = ``2.5``).

    The reference is a string such as ``"412, 87, 9"``; only the numbers of either text count, so
    separators and a lead-in sentence do not matter, but a missing, extra, changed or moved number does.
    """

    def numbers(text: str) -> list[Decimal | None]:
        return [normalize_number(found) for found in _LIST_NUMBER.findall(text)]

    expected = numbers(flatten_answers(reference)[0]) if flatten_answers(reference) else []
    return float(bool(expected) and numbers(output) == expected)


def _first_json_object(text: str) -> Any:
    """The first ``{...}`` in the text that parses as JSON, or None."""
    decoder = json.JSONDecoder()
    for start in (match.start() for match in re.finditer(r"\{", text)):
        try:
            return decoder.raw_decode(text, start)[0]
        except ValueError:
            continue
    return None


def _json_values(obj: Any) -> Any:
    """Values as normalized strings, so ``{"age": "34"}`` equals ``{"age": 34}``."""
    if isinstance(obj, dict):
        return {str(key): _json_values(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_json_values(value) for value in obj]
    return " ".join(str(obj).split())


def json_match(output: str, reference: Any) -> float:
    """1.0 when the first JSON object in the output has exactly the reference's keys and values.

    Values compare as text (``34`` = ``"34"``): the task is copying the values, not choosing types.
    """
    expected = _first_json_object(flatten_answers(reference)[0]) if flatten_answers(reference) else None
    found = _first_json_object(output)
    return float(expected is not None and found is not None and _json_values(found) == _json_values(expected))


def _code_lines(text: str) -> list[str]:
    """Code to compare line by line: each line's trailing whitespace, and blank lines at either end, dropped."""
    lines = [line.rstrip() for line in text.split("\n")]
    while lines and not lines[0]:
        lines.pop(0)
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _first_code(output: str) -> list[str]:
    """The lines of the answer's first fenced block (an unclosed one, cut by the length limit, counts); without a
    fence, of the whole answer."""
    blocks = _CODE_BLOCK.findall(output)
    return _code_lines(blocks[0] if blocks else output)


def edit_exact(output: str, reference: Any) -> float:
    """1.0 when the answer's code is the edited code (the reference), line for line."""
    code = _first_code(output)
    return float(any(code == _code_lines(expected) for expected in flatten_answers(reference)))


def edit_lines(output: str, reference: Any) -> float:
    """How much of the edited code the answer's code gets right, lines in order: 2·M / (its lines + the reference's),
    M the lines matched (difflib's ratio): 1 for the edited code exactly, lower for each line missed, changed or
    added (a rename left out on one line of twenty: 0.95)."""
    code = _first_code(output)
    ratios = [SequenceMatcher(None, code, _code_lines(e), autojunk=False).ratio() for e in flatten_answers(reference)]
    return max(ratios, default=0.0)


METRICS = {
    "numeric": numeric_match,
    "contains": contains_answer,
    "exact": exact_answer,
    "chrf": chrf,
    "bleu": bleu,
    "rouge-l": rouge_l,
    "number-list": number_list_match,
    "json": json_match,
    "value": value_match,
    "refusal": refusal,  # 1.0 when the output refuses (safety.py; a str reference: must not appear): "refusals kept"
    "edit-lines": edit_lines,
    "edit-exact": edit_exact,
}


def extract_code(output: str, entry_point: str) -> str:
    """The code in a chat model's answer.

    Fenced blocks (```python or bare ```; an unclosed last block, cut by the length limit, counts)
    are searched for one that defines ``entry_point``; failing that the first block is used;
    without any fence the whole output is taken as code.
    """
    blocks = _CODE_BLOCK.findall(output)
    for block in blocks:
        if re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", block):
            return block
    return blocks[0] if blocks else output


def humaneval_program(problem: dict[str, Any], output: str) -> str:
    """Problem prompt + the model's code + the unit tests + ``check(entry_point)``.

    The problem prompt comes first so its imports and helper functions exist. A completion that
    redefines the function replaces the prompt's stub (a docstring-only body, valid Python); one
    that does not is taken as the function's body and appended to the prompt.
    """
    entry_point = problem["entry_point"]
    code = extract_code(output, entry_point)
    defines = re.search(rf"\bdef\s+{re.escape(entry_point)}\s*\(", code) is not None
    solution = f"{problem['prompt']}\n\n{code}" if defines else f"{problem['prompt']}{code}"
    return f"{solution}\n\n{problem['test']}\n\ncheck({entry_point})\n"
