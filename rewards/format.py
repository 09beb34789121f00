"""Format rewards: did the model put its final answer where the grader will look for it?

    boxed(prompt: str, completion: str, meta: dict) -> float
    answer_tag(prompt: str, completion: str, meta: dict, tag: str = "answer") -> float

boxed: 1.0 if the completion contains \\boxed{...} (or \\fbox{...}) with balanced braces and
non-blank content, else 0.0. Nested braces count: \\boxed{\\frac{1}{2}} is one answer.
answer_tag: 1.0 if the completion contains <answer>...</answer> (any tag name via `tag`) with
non-blank content, else 0.0. Neither looks at whether the answer is right (math.py does).

Typically a small weight next to a correctness reward:

    rewards:
      - {fn: "rewards.math:correctness", weight: 1.0}
      - {fn: "rewards.format:boxed", weight: 0.1}
"""

from __future__ import annotations

import re

BOX_COMMANDS = ("\\boxed{", "\\fbox{")


def boxed_contents(text: str) -> list[str]:
    """The contents of every \\boxed{...} / \\fbox{...} in `text` whose braces are balanced."""
    found = []
    for command in BOX_COMMANDS:
        start = text.find(command)
        while start != -1:
            depth, position = 1, start + len(command)
            while position < len(text) and depth:
                depth += {"{": 1, "}": -1}.get(text[position], 0)
                position += 1
            if depth == 0:
                found.append(text[start + len(command) : position - 1])
            start = text.find(command, start + 1)
    return found


def boxed(prompt: str, completion: str, meta: dict) -> float:
    return 1.0 if any(content.strip() for content in boxed_contents(completion)) else 0.0


def answer_tag(prompt: str, completion: str, meta: dict, tag: str = "answer") -> float:
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    return 1.0 if any(match.strip() for match in pattern.findall(completion)) else 0.0
