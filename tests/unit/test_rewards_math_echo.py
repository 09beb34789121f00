"""rewards.math:correctness credits only what a completion states as its answer.

An RL run optimises whatever the reward pays for. A reward that parses the first expression it can
find pays for echoing the question back ("11 + 6 is ..." parses as 11 + 6 = 17), and the policy
learns to echo. The corpus below is what a policy tries; every line is scored against the gold
answer of its prompt."""

from __future__ import annotations

import pytest

math_reward = pytest.importorskip("rewards.math", reason="math-verify is not installed")

PROMPT, GOLD = "What is 11 + 6?", "17"

NOT_AN_ANSWER = [
    # the question echoed back: its expression evaluates to the gold answer, but nothing is stated
    "11 + 6 is a well-known calculation that many students learn early.",
    "11 + 6",
    "What is 11 + 6?",
    "Let me think about 11 + 6.",
    "The answer is 11 + 6.",
    "\\boxed{11 + 6}",
    # the question's arithmetic rearranged, left unevaluated
    "\\boxed{6 + 11}",
    "The answer is 6+11.",
    "$6 + 11$",
    "\\boxed{(6) + (11)}",
    "We need $11 + 6$.",
    # a restatement, in words
    "11 + 6 equals eleven plus six",
    "11 + 6 is the sum of eleven and six.",
    # partial answers: a digit of it, a truncated line, no number at all
    "11 + 6 = 1",
    "The answer is 1",
    "1",
    "11 + 6 =",
    "The answer is",
    "I am not sure.",
    "",
    # a right intermediate, then a wrong final answer
    "11 + 6 = 17, no wait: 11 + 6 = 18",
    "First 11 + 6 = 17. Then I add one, so the answer is 18.",
    "11 + 6 = 17. Rounding to the nearest ten gives 20.",
    "I first thought \\boxed{17}, but it is \\boxed{16}.",
]

AN_ANSWER = [
    "11 + 6 = 17",
    "11 + 6 = 17.",
    "The answer is 17.",
    "The answer is 17",
    "Answer: 17",
    "\\boxed{17}",
    "So we get \\boxed{17}.",
    "It's 17",
    "17",
    "Adding the units, 1 + 6 = 7, and carrying nothing, the total is 17.",
    "We have $11 + 6 = 17$.",
    "The final answer is $17$.",
    "I first thought 18, but the answer is 17.",
]


@pytest.mark.parametrize("completion", NOT_AN_ANSWER)
def test_an_echo_a_restatement_a_partial_or_a_wrong_final_answer_scores_zero(completion):
    assert math_reward.correctness(PROMPT, completion, {"answer": GOLD}) == 0.0


@pytest.mark.parametrize("completion", AN_ANSWER)
def test_a_stated_answer_scores_one(completion):
    assert math_reward.correctness(PROMPT, completion, {"answer": GOLD}) == 1.0


@pytest.mark.parametrize("prompt, completion, gold, expected", [
    ("What is 34 - 17?", "17", "17", 1.0),  # a bare number that is also in the prompt is an answer
    ("Simplify (2x^2 + 2)/2.", "\\boxed{x^2+1}", "1 + x^2", 1.0),  # symbolic answers still verify
    ("Expand (x+1)^2.", "\\boxed{(x+1)^2}", "x^2+2x+1", 0.0),  # ... but the prompt's expression is no answer
    ("Expand (x+1)^2.", "So $(x+1)^2 = x^2 + 2x + 1$", "x^2+2x+1", 1.0),  # a formula stated in math: its right-hand side
    ("Which is larger, \\frac{3}{4} or \\frac{2}{3}?", "\\boxed{\\frac{3}{4}}", "3/4", 1.0),  # a literal from the prompt
    ("How many?", "There are 1,000 of them.", "1000", 1.0),
    ("What is 2 - 7?", "2 - 7 = -5", "-5", 1.0),
    ("What is half of 1?", "We get $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),
    ("What is 3 / 6?", "So 3 / 6 = 0.5", "1/2", 1.0),
    ("What is 3 / 6?", "3 / 6", "1/2", 0.0),
    ("What is 5 times 2?", "\\boxed{2 \\times 5}", "10", 0.0),  # rearranged, in LaTeX
    ("What is 2 to the power 10?", "\\boxed{2^10}", "1024", 0.0),
    ("What is 11 + 6?", "\\boxed{10 + 7}", "17", 1.0),  # the completion's own arithmetic, not the prompt's
    ("Simplify 2x + 3x.", "\\boxed{5x}", "5x", 1.0),  # a letter: never arithmetic on the prompt's numbers
    ("What is 4 + 4?", "\\boxed{4 + 4}", "8", 0.0),  # both 4s of the prompt
    ("What is 4 + 2?", "\\boxed{4 + 4 - 2}", "6", 1.0),  # a 4 the prompt has once: the completion's own
])
def test_other_prompts(prompt, completion, gold, expected):
    assert math_reward.correctness(prompt, completion, {"answer": gold}) == expected
