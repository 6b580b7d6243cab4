"""Synthetic tasks: seeded, generated items with short answers that a 135M model can give.

The vendored benchmarks (HumanEval, GSM8K, Spec-Bench) are too hard for the tiny models flyspec is
tried on (SmolLM2-135M scores ~0 on them), and a retention ratio of two near-zero scores says
nothing. These tasks ask for what a tiny model *can* do — copy a value from the prompt, add two
small numbers — and for what a loose accept can quietly corrupt: digits, names and identifiers.
Every answer is checked exactly or near-exactly (``scoring.py``), so a swapped digit is a miss.

=======  ===================================================================  ===========  ====
task     item                                                                 metric       kind
=======  ===================================================================  ===========  ====
extract  a record (name, city, age, date, ID, email) in one of three layouts;  value        text
         one field asked
numbers  3-5 numbers separated by spaces, semicolons, slashes or new lines;    number-list  text
         rewrite them comma-separated
passage  a three-sentence story with two people, two places, two numbers;     value        text
         one fact asked
arith    ``a + b`` or ``a - b`` with a, b in 1..20                             numeric      text
code     a four-line Python function; the function's name, its first          value        code
         parameter or the number assigned to a variable asked
units    ``7 km = 7 x 1000 m = ?``: a power-of-ten conversion, product given   numeric      text
json     a JSON object with a name and one more given key and value           json         text
=======  ===================================================================  ===========  ====

Items are drawn from ``random.Random(f"{SEED}/{task}")`` (a string seed is hashed with SHA-512,
so the items depend neither on ``PYTHONHASHSEED`` nor on the platform): the same seed gives the
same items, and the first ``n`` items do not depend on how many are asked for. ``value`` items
carry the prompt's other values (less those the question names) in ``extra["distractors"]``: the
answer must be the candidate the output names first, so copying the whole record back fails.
A rename task (rewrite a line of Python with one identifier renamed) was tried and dropped:
SmolLM2-135M-Instruct got 1 in 10 right at best, whatever the wording.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass

from flyspec.eval.data import EvalItem

SEED = 11
NUM_ITEMS = 200

FIRST_NAMES = (
    "Maria", "Kenji", "Amara", "Lars", "Priya", "Tomasz", "Fatima", "Diego", "Ingrid", "Kwame",
    "Sofia", "Hiroshi", "Elena", "Mateo", "Aisha", "Oliver", "Yuki", "Nadia", "Samuel", "Leila",
    "Viktor", "Chloe", "Rahul", "Greta", "Emeka", "Lucia", "Anders", "Mei", "Pablo", "Zara",
    "Henrik", "Ana", "Tariq", "Freya", "Jonas", "Imani", "Carlos", "Hana", "Felix", "Noor",
)  # fmt: skip
SURNAMES = (
    "Lopez", "Sato", "Okafor", "Nilsson", "Nair", "Kowalski", "Haddad", "Romero", "Berg", "Mensah",
    "Rossi", "Tanaka", "Petrova", "Silva", "Khan", "Turner", "Mori", "Ivanova", "Adeyemi", "Farah",
    "Novak", "Dubois", "Sharma", "Vogel", "Eze", "Moreno", "Holm", "Chen", "Ruiz", "Malik",
)  # fmt: skip
CITIES = (
    "Lisbon", "Osaka", "Lagos", "Uppsala", "Pune", "Krakow", "Beirut", "Seville", "Bergen", "Accra",
    "Turin", "Sapporo", "Kazan", "Recife", "Lahore", "Leeds", "Nagoya", "Odessa", "Ibadan", "Mombasa",
    "Brno", "Lyon", "Jaipur", "Graz", "Enugu", "Valencia", "Aarhus", "Xiamen", "Cusco", "Karachi",
)  # fmt: skip
MONTHS = (
    "January", "February", "March", "April", "May", "June",
    "July", "August", "September", "October", "November", "December",
)  # fmt: skip


@dataclass(frozen=True)
class SyntheticTask:
    """A generated task: ``make(rng, index)`` builds item ``index`` from the task's own generator."""

    name: str
    kind: str
    metric: str
    max_new_tokens: int
    make: Callable[[random.Random, int], EvalItem]


def _full_name(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(1960, 2023)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _id_code(rng: random.Random) -> str:
    letters = "".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(2))
    return f"{letters}-{rng.randint(1000, 9999)}"


def _distractors(values: list[str], question: str) -> list[str]:
    """The prompt's other values, less those the question itself names (restating it is no error)."""
    return [value for value in values if value not in question]


# --- extract: one field of a record ------------------------------------------------------------

_FIELD_QUESTIONS = {
    "name": "What is the name",
    "city": "What is the city",
    "age": "What is the age",
    "date": "What is the start date",
    "id": "What is the ID",
    "email": "What is the email address",
}


def _extract(rng: random.Random, index: int) -> EvalItem:
    name = _full_name(rng)
    first, last = name.split()
    fields = {
        "name": name,
        "city": rng.choice(CITIES),
        "age": str(rng.randint(19, 87)),
        "date": _date(rng),
        "id": _id_code(rng),
        "email": f"{first[0].lower()}.{last.lower()}{rng.randint(1, 99)}@example.com",
    }
    shown = ["name", *rng.sample(["city", "age", "date", "id", "email"], 3)]
    rng.shuffle(shown)
    asked = rng.choice(shown)
    labels = {"date": "start date", "id": "ID", "email": "email"}
    layout = rng.randrange(3)
    if layout == 0:
        record = "\n".join(f"{labels.get(key, key)}: {fields[key]}" for key in shown)
    elif layout == 1:
        record = "; ".join(f"{labels.get(key, key)}={fields[key]}" for key in shown)
    else:
        record = ", ".join(f'"{labels.get(key, key)}": "{fields[key]}"' for key in shown)
        record = "{" + record + "}"
    prompt = f"Record:\n{record}\n\n{_FIELD_QUESTIONS[asked]} in this record? Answer with the value only."
    distractors = [fields[key] for key in shown if key != asked]
    return EvalItem(f"extract/{index}", prompt, fields[asked], {"distractors": distractors})


# --- numbers: rewrite a list comma-separated -----------------------------------------------------


def _numbers(rng: random.Random, index: int) -> EvalItem:
    values = [str(rng.choice((rng.randint(0, 99), rng.randint(100, 999)))) for _ in range(rng.randint(3, 5))]
    separator, described = rng.choice(((" ", "spaces"), ("; ", "semicolons"), ("\n", "new lines"), (" / ", "slashes")))
    shown = separator.join(values)
    prompt = (
        f"Here are some numbers separated by {described}:\n{shown}\n\n"
        "Write the same numbers in the same order, separated by commas. Reply with the list only."
    )
    return EvalItem(f"numbers/{index}", prompt, ", ".join(values))


# --- passage: one fact from a short story -------------------------------------------------------

# Each story holds two values of each kind (two people, two places, two numbers), so a question
# picks one of them and naming the other first is a miss.
_PASSAGES = (
    (
        "{name} moved from {city2} to {city} in {year}. There {first} and a friend, {name2}, opened a bakery "
        "called {title}. It sells {count} loaves of bread every day.",
        {
            "name": "Who moved from {city2} to {city}?",
            "name2": "Who opened the bakery with {first}?",
            "city": "Which city did {first} move to?",
            "city2": "Which city did {first} move from?",
            "year": "In which year did {first} move?",
            "title": "What is the bakery called?",
            "count": "How many loaves does the bakery sell every day?",
        },
    ),
    (
        "The ship {title} left {city} for {city2} on {month} {day} with {count} passengers. Its captain, {name}, "
        "had sailed since {year}. The cook was {name2}.",
        {
            "name": "Who was the captain of the ship?",
            "name2": "Who was the cook?",
            "city": "Which city did the ship leave from?",
            "city2": "Where was the ship going?",
            "year": "Since which year had the captain sailed?",
            "title": "What was the name of the ship?",
            "count": "How many passengers were on the ship?",
            "month": "In which month did the ship leave?",
        },
    ),
    (
        "In {year}, {name} founded a lab in {city} to study {topic}. The lab now has {count} members. "
        "Its first paper, written with {name2} from {city2}, was called {title}.",
        {
            "name": "Who founded the lab?",
            "name2": "Who helped write the lab's first paper?",
            "city": "In which city is the lab?",
            "city2": "Where is {name2_first} from?",
            "year": "In which year was the lab founded?",
            "title": "What was the lab's first paper called?",
            "count": "How many members does the lab have?",
            "topic": "What does the lab study?",
        },
    ),
)
_TITLES = (
    "Golden Crust", "Blue Heron", "Northern Star", "Silver Oak", "Red Lantern", "Morning Tide",
    "Iron Gate", "Green Harbor", "Quiet River", "Bright Mill", "Stone Bridge", "Amber Leaf",
)  # fmt: skip
_TOPICS = ("coral reefs", "bird songs", "old maps", "soil bacteria", "glaciers", "honey bees", "volcanoes")


def _passage(rng: random.Random, index: int) -> EvalItem:
    template, questions = rng.choice(_PASSAGES)
    first, first2 = rng.sample(FIRST_NAMES, 2)
    city, city2 = rng.sample(CITIES, 2)
    values = {
        "name": f"{first} {rng.choice(SURNAMES)}",
        "name2": f"{first2} {rng.choice(SURNAMES)}",
        "city": city,
        "city2": city2,
        "year": str(rng.randint(1950, 2022)),
        "title": rng.choice(_TITLES),
        "count": str(rng.randint(30, 480)),
        "month": rng.choice(MONTHS),
        "day": str(rng.randint(1, 28)),
        "topic": rng.choice(_TOPICS),
    }
    asked = rng.choice(sorted(questions))
    names = {"first": first, "name2_first": first2}
    passage = template.format(**values, **names)
    question = questions[asked].format(**values, **names)
    prompt = f"{passage}\n\nQuestion: {question} Answer with a few words from the text."
    shown = [values[key] for key in values if "{" + key + "}" in template and key != asked]
    return EvalItem(f"passage/{index}", prompt, values[asked], {"distractors": _distractors(shown, question)})


# --- arith: a + b, a - b --------------------------------------------------------------------------


def _arith(rng: random.Random, index: int) -> EvalItem:
    a, b = rng.randint(1, 20), rng.randint(1, 20)
    if rng.random() < 0.5:
        expression, answer = f"{a} + {b}", a + b
    else:
        a, b = max(a, b), min(a, b)
        expression, answer = f"{a} - {b}", a - b
    prompt = f"What is {expression}? Answer with the number only."
    return EvalItem(f"arith/{index}", prompt, str(answer))


# --- code: a name or a number from a small Python function --------------------------------------

_FUNCTIONS = (
    "load_page", "scale_values", "parse_row", "sum_prices", "clean_text", "merge_lists", "count_words",
    "fetch_user", "split_batch", "update_cache", "find_peak", "build_index", "read_config", "send_report",
)  # fmt: skip
_VARIABLES = (
    "unit_price", "item_count", "max_width", "box_height", "final_score", "start_offset", "row_limit",
    "page_index", "base_value", "top_speed", "net_weight", "old_balance", "tax_rate", "chunk_size",
    "step2", "deltaX", "userLevel", "budget_2024", "safety_margin", "total_sum", "retryCount", "x1",
)  # fmt: skip
_CODE_QUESTIONS = {
    "function": "What is the name of the function defined in this code? Answer with the name only.",
    "constant": "What number is assigned to `{constant_name}`? Answer with the number only.",
    "first_parameter": "What is the name of the first parameter of the function? Answer with the name only.",
}


def _code(rng: random.Random, index: int) -> EvalItem:
    function = rng.choice(_FUNCTIONS)
    first, second, constant_name, result = rng.sample(_VARIABLES, 4)
    constant = str(rng.randint(2, 999))
    operator = rng.choice("+-*")
    source = (
        f"def {function}({first}, {second}):\n"
        f"    {constant_name} = {constant}\n"
        f"    {result} = {first} {operator} {second} + {constant_name}\n"
        f"    return {result}\n"
    )
    values = {
        "function": function,
        "first_parameter": first,
        "second": second,
        "constant_name": constant_name,
        "constant": constant,
        "result": result,
    }
    asked = rng.choice(sorted(_CODE_QUESTIONS))
    question = _CODE_QUESTIONS[asked].format(constant_name=constant_name)
    prompt = f"```python\n{source}```\n\n{question}"
    others = [value for key, value in values.items() if key != asked]
    return EvalItem(f"code/{index}", prompt, values[asked], {"distractors": _distractors(others, question)})


# --- units: a conversion with its factor given ----------------------------------------------------

# Powers of ten only, and the product spelled out: SmolLM2-135M gets "4 x 60" wrong more often
# than not, and a task the plain model fails says nothing about what a loose accept costs.
_UNITS = (
    ("km", "m", 1000),
    ("m", "cm", 100),
    ("m", "mm", 1000),
    ("cm", "mm", 10),
    ("dm", "cm", 10),
    ("kg", "g", 1000),
    ("g", "mg", 1000),
    ("t", "kg", 1000),
    ("L", "mL", 1000),
    ("kW", "W", 1000),
    ("s", "ms", 1000),
    ("kHz", "Hz", 1000),
)


def _units(rng: random.Random, index: int) -> EvalItem:
    source, target, factor = rng.choice(_UNITS)
    amount = rng.randint(2, 20)
    prompt = f"{amount} {source} = {amount} x {factor} {target} = ? Reply with the result only."
    return EvalItem(f"units/{index}", prompt, str(amount * factor))


# --- json: an object with given keys and values ---------------------------------------------------


def _json(rng: random.Random, index: int) -> EvalItem:
    name = _full_name(rng)
    candidates = {
        "name": name,
        "city": rng.choice(CITIES),
        "age": rng.randint(19, 87),
        "id": _id_code(rng),
        "year": rng.randint(1950, 2023),
    }
    keys = ["name", rng.choice(["city", "age", "id", "year"])]
    rng.shuffle(keys)
    obj = {key: candidates[key] for key in keys}
    listed = ", ".join(f"{key} = {value}" for key, value in obj.items())
    prompt = f"Write a JSON object with these keys and values: {listed}. Reply with the JSON only."
    return EvalItem(f"json/{index}", prompt, json.dumps(obj))


SYNTHETIC_TASKS = {
    task.name: task
    for task in (
        SyntheticTask("extract", "text", "value", 24, _extract),
        SyntheticTask("numbers", "text", "number-list", 32, _numbers),
        SyntheticTask("passage", "text", "value", 24, _passage),
        SyntheticTask("arith", "text", "numeric", 16, _arith),
        SyntheticTask("code", "code", "value", 24, _code),
        SyntheticTask("units", "text", "numeric", 32, _units),
        SyntheticTask("json", "text", "json", 32, _json),
    )
}


def make_items(name: str, count: int = NUM_ITEMS, seed: int = SEED) -> list[EvalItem]:
    """The first ``count`` items of synthetic task ``name``; the same seed always gives the same items.

    A drawn item whose prompt an earlier item already has is drawn again, so every prompt is
    different (``arith`` and ``units`` have a few hundred possible prompts, and a repeated item
    would count twice in the confidence intervals).
    """
    task = SYNTHETIC_TASKS[name]
    rng = random.Random(f"{seed}/{name}")
    items: list[EvalItem] = []
    seen: set[str] = set()
    for _ in range(50 * count):
        if len(items) == count:
            break
        item = task.make(rng, len(items))
        if item.prompt not in seen:
            seen.add(item.prompt)
            items.append(item)
    if len(items) < count:
        raise ValueError(f"synthetic task {name!r} has fewer than {count} different items")
    return items
