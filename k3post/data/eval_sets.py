"""Evaluation data: the small eval sets k3post ships (generated here, deterministically) and one
loader for every place an eval task's rows come from.

Shipped sets (`builtin:<name>`; no randomness: the same rows and ids on every machine):
- `arith`: 300 arithmetic word problems (two steps each) with integer answers, for a math
  verifier. Disjoint from the training set `builtin:math` (other templates and numbers).
- `code`: 40 small Python function tasks, each with assert tests, for the sandboxed code verifier.
- `reference`: 200 prompt/reply pairs whose replies are plain, predictable sentences: a held-out
  reference set for NLL.
- `heldout-chat`: 120 everyday requests unlike the training prompts of `builtin:chat`, for the
  distillation-quality (KL) task.
- `style-chat`: the same requests, each with the opening the context-distillation style guide
  mandates as its answer ("In short:"; recipes/teachers/smollm2-style.yaml), for the
  `rewards.style:opens_with` verifier.
The training sets `builtin:chat` and `builtin:math` (data/builtin_prompts.py) load too.

Other rows come from a .jsonl/.json/.parquet file (through data/sources.py, so the same errors
name the file and row) or, when online, from the Hugging Face hub: `hub:<dataset>` with the
task's `split` and `subset`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import product
from pathlib import Path

from k3post.config.errors import UserError
from k3post.data.sources import load_prompt_rows

BUILTIN, HUB = "builtin:", "hub:"

_NAMES = ("Ava", "Noah", "Zoe", "Ethan", "Ivy", "Lucas", "Nora", "Felix", "Ruby", "Hugo")
_THINGS = ("shells", "coins", "buttons", "crayons", "beads", "tickets", "seeds", "keys", "pebbles", "badges")
_ANSWER_HINT = " Give the final answer as a number."


def _arith_rows() -> Iterator[dict]:
    """Five two-step templates over a 6 × 10 grid of (a, b): 300 problems, answers ≥ 0."""
    grid = list(product(range(3, 9), range(1, 11)))
    kinds: list[Callable[[int, int, str, str], tuple[str, int]]] = [
        lambda a, b, n, t: (f"{n} has {a * 3} {t}, finds {b} more and then loses {a}. How many {t} "
                            f"does {n} have?", a * 3 + b - a),
        lambda a, b, n, t: (f"There are {a} bags with {b + 2} {t} in each. {n} takes {b} {t} out. How "
                            f"many {t} are left in the bags?", a * (b + 2) - b),
        lambda a, b, n, t: (f"{n} buys {b} packs of {t}. Each pack has {a} {t}. {n} gives half of them "
                            f"away. How many {t} does {n} keep?", a * b - (a * b) // 2),
        lambda a, b, n, t: (f"What is {a * 7} + {b * 3} - {a}?", a * 7 + b * 3 - a),
        lambda a, b, n, t: (f"What is ({a} + {b}) times {a - 1}?", (a + b) * (a - 1)),
    ]
    for kind in kinds:
        for i, (a, b) in enumerate(grid):
            prompt, answer = kind(a, b, _NAMES[i % len(_NAMES)], _THINGS[(7 * i) % len(_THINGS)])
            yield {"prompt": prompt + _ANSWER_HINT, "answer": str(answer)}


# (function name, what it does, its arguments, then (call, expected) pairs for the tests)
_CODE_TASKS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("add", "returns the sum of a and b", "a, b", [("1, 2", "3"), ("-4, 4", "0"), ("10, 5", "15")]),
    ("is_even", "returns True if n is even and False otherwise", "n", [("4", "True"), ("7", "False"), ("0", "True")]),
    ("reverse_string", "returns the string s reversed", "s", [("'abc'", "'cba'"), ("''", "''"), ("'ab'", "'ba'")]),
    ("maximum", "returns the largest number in the non-empty list xs", "xs",
     [("[1, 5, 3]", "5"), ("[-2, -9]", "-2"), ("[7]", "7")]),
    ("count_vowels", "returns how many vowels (a, e, i, o, u) the lowercase string s has", "s",
     [("'hello'", "2"), ("'sky'", "0"), ("'aeiou'", "5")]),
    ("factorial", "returns n! for n >= 0", "n", [("0", "1"), ("5", "120"), ("3", "6")]),
    ("square_all", "returns a list with the square of every number in xs", "xs",
     [("[1, 2, 3]", "[1, 4, 9]"), ("[]", "[]"), ("[-2]", "[4]")]),
    ("first_char", "returns the first character of the non-empty string s", "s", [("'cat'", "'c'"), ("'z'", "'z'")]),
    ("sum_list", "returns the sum of the numbers in xs", "xs", [("[1, 2, 3]", "6"), ("[]", "0"), ("[-1, 1]", "0")]),
    ("is_palindrome", "returns True if the string s reads the same backwards", "s",
     [("'level'", "True"), ("'abc'", "False"), ("''", "True")]),
]
_SCALE_TASKS: list[tuple[str, str, Callable[[int, int], int]]] = [
    ("multiply_by_{k}", "returns x multiplied by {k}", lambda x, k: x * k),
    ("add_{k}", "returns x plus {k}", lambda x, k: x + k),
    ("remainder_{k}", "returns the remainder of x divided by {k}", lambda x, k: x % k),
]


def _code_rows() -> Iterator[dict]:
    """Ten fixed tasks, then three families × ten constants: 40 tasks with assert tests."""
    for name, what, args, cases in _CODE_TASKS:
        yield _code_row(name, what, args, [f"assert {name}({call}) == {expected}" for call, expected in cases])
    for (name_t, what_t, fn), k in product(_SCALE_TASKS, range(2, 12)):
        name = name_t.format(k=k)
        tests = [f"assert {name}({x}) == {fn(x, k)}" for x in (0, 3, 17)]
        yield _code_row(name, what_t.format(k=k), "x", tests)


def _code_row(name: str, what: str, args: str, tests: list[str]) -> dict:
    prompt = (f"Write a Python function `{name}({args})` that {what}. Reply with the code in a "
              f"```python code block.")
    return {"prompt": prompt, "tests": tests, "entry_point": name}


_OPPOSITES = (("hot", "cold"), ("up", "down"), ("big", "small"), ("fast", "slow"), ("day", "night"),
              ("happy", "sad"), ("open", "closed"), ("light", "dark"), ("wet", "dry"), ("old", "new"))
_COLOURS = (("the sky on a clear day", "blue"), ("fresh grass", "green"), ("a ripe banana", "yellow"),
            ("snow", "white"), ("coal", "black"), ("a ripe tomato", "red"), ("an orange", "orange"),
            ("a lemon", "yellow"), ("a violet", "purple"), ("chocolate", "brown"))


def _reference_rows() -> Iterator[dict]:
    """Replies a competent model predicts well: sums, opposites, colours, counting, days."""
    for a, b in product(range(2, 12), range(3, 11, 2)):  # 40
        yield {"prompt": f"What is {a} plus {b}?", "completion": f"{a} plus {b} is {a + b}."}
    for (word, opposite), form in product(_OPPOSITES, range(4)):  # 40
        question = ("What is the opposite of {}?", "Give the opposite of the word {}.",
                    "Name the opposite of {}.", "Tell me the antonym of {}.")[form]
        yield {"prompt": question.format(word), "completion": f"The opposite of {word} is {opposite}."}
    for (thing, colour), form in product(_COLOURS, range(4)):  # 40
        question = ("What color is {}?", "Which color is {}?", "Tell me the color of {}.",
                    "Name the color of {}.")[form]
        yield {"prompt": question.format(thing), "completion": f"The color of {thing} is {colour}."}
    for start, length in product(range(1, 9), range(3, 8)):  # 40
        numbers = ", ".join(str(start + i) for i in range(length))
        yield {"prompt": f"Count from {start} to {start + length - 1}.", "completion": f"{numbers}."}
    days = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
    for i, form in product(range(7), range(6)):  # 42, trimmed to 40
        if i * 6 + form >= 40:
            continue
        question = ("What day comes after {}?", "Which day follows {}?", "Name the day after {}.",
                    "What is the next day after {}?", "If today is {}, what day is tomorrow?",
                    "Tell me the day after {}.")[form]
        yield {"prompt": question.format(days[i]), "completion": f"The day after {days[i]} is {days[(i + 1) % 7]}."}


_TOPICS = ("a good morning routine", "choosing a book to read", "planning a picnic", "learning to swim",
           "writing a thank-you note", "starting to run", "a rainy weekend", "keeping a plant alive",
           "packing a school bag", "making a sandwich", "a first day at work", "saving for a bike")
_ASKS = ("Give me one short tip about {}.", "Write two sentences about {}.", "What should I know about {}?",
         "Explain {} to a child in one sentence.", "List two ideas for {}.", "Why does {} matter?",
         "What is a common mistake in {}?", "Describe {} in one sentence.", "Give me a fun fact about {}.",
         "What is the first step of {}?")


def _heldout_chat_rows() -> Iterator[dict]:
    for ask, topic in product(_ASKS, _TOPICS):
        yield {"prompt": ask.format(topic)}


STYLE_OPENING = "In short:"  # rule 1 of recipes/teachers/smollm2-style.yaml


def _style_chat_rows() -> Iterator[dict]:
    for row in _heldout_chat_rows():
        yield {**row, "answer": STYLE_OPENING}


_SETS: dict[str, Callable[[], Iterator[dict]]] = {
    "arith": _arith_rows, "code": _code_rows, "reference": _reference_rows, "heldout-chat": _heldout_chat_rows,
    "style-chat": _style_chat_rows,
}


def eval_set_names() -> list[str]:
    return sorted(_SETS)


def builtin_eval_set(name: str) -> list[dict]:
    """The rows of a shipped eval set, with stable ids "<name>-0001", ..."""
    return [{"id": f"{name}-{i:04d}", **row} for i, row in enumerate(_SETS[name](), start=1)]


def load_eval_rows(spec: str, base_dir: Path, split: str = "test", subset: str | None = None,
                   prompt_field: str = "prompt") -> tuple[list[dict], str]:
    """(normalised rows, a label naming where they came from) for `spec`.

    Rows are normalised as prompt rows are ({"id", "messages", **other fields}); the label is
    the file path (or builtin:/hub: name) that error messages about a row should name.
    """
    if spec.startswith(BUILTIN) and spec[len(BUILTIN):] in _SETS:
        rows = builtin_eval_set(spec[len(BUILTIN):])
        return load_prompt_rows_from(rows, spec), spec
    if spec.startswith(HUB):
        return _hub_rows(spec[len(HUB):], split, subset, prompt_field), spec
    path = Path(spec).expanduser()
    label = spec if spec.startswith(BUILTIN) else str(path if path.is_absolute() else Path(base_dir) / path)
    return load_prompt_rows(spec, base_dir), label


def load_prompt_rows_from(rows: list[dict], label: str) -> list[dict]:
    """Normalise in-memory rows like file rows: ids kept, a `prompt` becomes one user turn."""
    out = []
    for index, row in enumerate(rows):
        prompt = row.get("prompt")
        if not isinstance(prompt, str) or not prompt.strip():
            raise UserError(f"{label} row {index}: expected a non-empty string field 'prompt'")
        rest = {k: v for k, v in row.items() if k not in ("id", "prompt")}
        out.append({"id": str(row.get("id", f"{label}-{index}")), "messages": [("user", prompt)], **rest})
    return out


def _hub_rows(name: str, split: str, subset: str | None, prompt_field: str) -> list[dict]:
    """A hub dataset through `datasets` (needs network unless it is in the local cache)."""
    import datasets  # noqa: PLC0415 - slow to import, and only needed here

    try:
        table = datasets.load_dataset(name, subset, split=split)
    except Exception as error:  # offline, a typo in the name, a missing split: say which
        raise UserError(f"hub:{name} (subset {subset}, split {split}): could not load the dataset: "
                        f"{type(error).__name__}: {error}"[:600]) from error
    rows = []
    for index, row in enumerate(table):
        if prompt_field not in row:
            raise UserError(f"hub:{name} row {index}: no field {prompt_field!r} (the task's prompt_field); "
                            f"fields: {sorted(row)}")
        rows.append({**{k: v for k, v in row.items() if k != prompt_field}, "prompt": str(row[prompt_field])})
    return load_prompt_rows_from(rows, f"hub:{name}")


def require_field(rows: list[dict], field: str, label: str, why: str) -> None:
    """Every row must carry a non-empty `field`; the first that does not is named (file, row, id)."""
    for index, row in enumerate(rows):
        value = row.get(field)
        if value is None or (isinstance(value, (str, list)) and len(value) == 0):
            keys = sorted(k for k in row if k != "messages")
            raise UserError(f"{label} row {index} (id {row.get('id')!r}): missing the field {field!r} ({why}); "
                            f"the row has {keys}")
