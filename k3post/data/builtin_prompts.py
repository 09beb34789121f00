"""Built-in prompt sets, so that the quickstart runs without network or data files.

Every set is generated from templates × slot values in a fixed order: no randomness, so the
same name gives the same rows (ids included) on every machine and Python version. The prompts
are short everyday requests a ~135M instruct model can answer in one to three sentences.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import product

from k3post.config.errors import UserError
from k3post.config.suggest import did_you_mean

# ---------------------------------------------------------------------------------------------
# chat: (template, slot values...) — each template is filled with every combination of its slots.
_CHAT_TEMPLATES: list[tuple] = [  # (template, slot values, [more slot values])
    ("Explain what {} is in one sentence.", (
        "a rainbow", "a volcano", "a library", "a bicycle", "a compass", "a thermometer",
        "a passport", "a recipe", "a telescope", "a glacier", "a lighthouse", "a calendar",
        "a battery", "a magnet", "a desert", "an island", "an umbrella", "an orchestra",
        "an email", "an airport", "a museum", "a password", "a microwave", "a vaccine",
        "a budget", "a habit", "a planet", "a river", "a bridge", "a map", "a cloud",
        "a keyboard", "a garden", "a newspaper", "a helmet", "a tornado", "a fossil",
        "a puzzle", "a vitamin", "a spreadsheet")),
    ("Suggest a {} idea with {}.", ("breakfast", "lunch", "dinner", "snack"), (
        "eggs", "rice", "spinach", "chickpeas", "potatoes", "tomatoes", "oats", "cheese",
        "chicken", "mushrooms")),
    ("Give me one tip for {}.", (
        "staying focused while studying", "sleeping better", "drinking more water",
        "keeping a tidy desk", "saving money", "learning a new language",
        "making friends at a new school", "staying calm before a test", "waking up early",
        "reading more books", "keeping houseplants alive", "writing a clear email",
        "cooking rice", "running a first 5K", "remembering names", "packing for a trip",
        "getting along with roommates", "starting a journal", "taking better photos",
        "staying warm in winter")),
    ("What is a good name for a pet {}?", (
        "goldfish", "hamster", "parrot", "turtle", "rabbit", "kitten", "puppy", "lizard",
        "guinea pig", "snake")),
    ("Describe the color {} to someone in one sentence.", (
        "blue", "red", "green", "yellow", "orange", "purple", "pink", "brown", "white",
        "black", "gray", "gold")),
    ("What is one fun thing to do with {} on a {} day?", ("friends", "your family", "a dog"), (
        "sunny", "rainy", "snowy", "windy", "cold", "hot", "cloudy", "foggy")),
    ("What does a {} do? Answer in one sentence.", (
        "baker", "firefighter", "librarian", "pilot", "dentist", "farmer", "plumber",
        "teacher", "nurse", "architect", "chef", "mechanic", "journalist", "gardener",
        "lifeguard")),
    ('What is the opposite of the word "{}"?', (
        "hot", "tall", "happy", "early", "open", "fast", "loud", "empty", "heavy", "bright",
        "ancient", "begin")),
    ("How do I {}? Keep it short.", (
        "boil an egg", "make a cup of tea", "tie a shoelace", "plant a seed",
        "fold a paper airplane", "clean a computer screen", "remove a coffee stain",
        "wash my hands properly", "make my bed quickly", "water a cactus")),
    ("Write one friendly sentence to {}.", (
        "thank a teacher", "welcome a new neighbor", "congratulate a friend on a new job",
        "apologize for being late", "invite a friend to lunch", "wish someone a good trip",
        "cheer up a sad friend", "say goodbye to a coworker")),
    ("Tell me one interesting fact about {}.", (
        "octopuses", "the moon", "honeybees", "volcanoes", "penguins", "the ocean",
        "elephants", "the sun", "trees", "owls", "the human heart", "snow")),
    ("Name one animal that lives in the {}.", (
        "ocean", "desert", "jungle", "Arctic", "forest", "savanna", "mountains", "river")),
    ('Give me two words that rhyme with "{}".', (
        "cat", "light", "blue", "rain", "star", "tree", "cake", "ring")),
    ("{}", (
        "Why is the sky blue?", "Why do leaves change color in autumn?",
        "Why do we need sleep?", "How many days are there in a week?",
        "What is the capital of France?", "Write a short greeting for a birthday card.",
        "Why do cats purr?", "What is the largest planet in our solar system?",
        "How can I be a better listener?", "What should I bring to a picnic?",
        "Why is exercise good for you?", "What is a polite way to say no to an invitation?",
        "How many legs does a spider have?", "What makes a good friend?",
        "Why do we have seasons?", "What is the boiling point of water in Celsius?",
        "Give me a short motivational quote.", "What is a healthy drink besides water?",
        "How do bees make honey?", "What is one way to reduce plastic waste?",
        "What is a fun hobby to try this weekend?", "How can I make my mornings less rushed?",
        "What should I say when I meet someone new?", "Why do birds fly south for winter?",
        "What is a simple way to be kind to a stranger?", "How do plants get their food?")),
]


def _chat_prompts() -> Iterator[dict]:
    """Every template filled with every combination of its slot values, in list order."""
    for template, *slots in _CHAT_TEMPLATES:
        for values in product(*slots):
            yield {"prompt": template.format(*values)}


# ---------------------------------------------------------------------------------------------
# math: each kind maps an (a, b) grid point to (prompt, exact answer). Names and items cycle
# with the grid index so word problems vary without any random draw.
_NAMES = ("Tom", "Anna", "Sam", "Maria", "Leo", "Priya", "Ben", "Mia", "Omar", "Lily")
_ITEMS = ("apples", "pencils", "stickers", "cookies", "marbles", "books", "oranges", "stamps",
          "balloons", "cards")
_GRID = list(product(range(2, 8), range(2, 7)))  # 6 × 5 = 30 points per kind

_MathKind = Callable[[int, int, str, str], tuple[str, int | str]]
_MATH_KINDS: list[_MathKind] = [
    lambda a, b, n, it: (f"What is {a + 5} + {b + 1}?", a + 5 + b + 1),
    lambda a, b, n, it: (f"What is {a + 11} - {b}?", a + 11 - b),
    lambda a, b, n, it: (f"What is {a} times {b}?", a * b),
    lambda a, b, n, it: (f"What is {a * b} divided by {b}?", a),
    lambda a, b, n, it: (f"{n} has {a} {it} and buys {b} more. How many {it} does {n} have now?",
                         a + b),
    lambda a, b, n, it: (f"{n} has {a + 7} {it} and gives {b - 1} to a friend. "
                         f"How many {it} does {n} have left?", a + 7 - (b - 1)),
    lambda a, b, n, it: (f"A box holds {a} {it}. How many {it} are in {b} boxes?", a * b),
    lambda a, b, n, it: (f"{n} shares {a * b} {it} equally among {b} friends. "
                         f"How many {it} does each friend get?", a),
    # Parity: a*5+b walks 12..41 over the grid, so every number appears once.
    lambda a, b, n, it: (f"Is {a * 5 + b} an even or odd number?",
                         "even" if (a * 5 + b) % 2 == 0 else "odd"),
]


def _math_prompts() -> Iterator[dict]:
    """Every kind over the whole grid; the answer is kept as a string for later verifiers."""
    for kind in _MATH_KINDS:
        for i, (a, b) in enumerate(_GRID):
            prompt, answer = kind(a, b, _NAMES[i % len(_NAMES)], _ITEMS[(3 * i) % len(_ITEMS)])
            yield {"prompt": prompt, "answer": str(answer)}


_SETS: dict[str, Callable[[], Iterator[dict]]] = {"chat": _chat_prompts, "math": _math_prompts}


def builtin_prompt_names() -> list[str]:
    """The names accepted by `builtin_prompt_set` (and by `builtin:<name>` source specs)."""
    return sorted(_SETS)


def unknown_set_message(name: str) -> str:
    """What a `builtin:<name>` naming no shipped set is told: the nearest name and the known ones."""
    hint = did_you_mean(name, builtin_prompt_names(), shown="builtin:{}")
    return f"unknown built-in prompt set {name!r}{hint} (known sets: {', '.join(builtin_prompt_names())})"


def builtin_prompt_set(name: str) -> list[dict]:
    """The rows of built-in set `name`: {"id": "<name>-0001", "prompt": ..., [...]}, stable order."""
    if name not in _SETS:
        raise UserError(unknown_set_message(name))
    return [{"id": f"{name}-{i:04d}", **row} for i, row in enumerate(_SETS[name](), start=1)]
