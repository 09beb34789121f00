"""The shipped reward functions in the top-level rewards/ package."""

from __future__ import annotations

import pytest

from rewards import code as code_reward
from rewards import format as format_reward
from rewards import length as length_reward

FENCE = "```"


def solution(body: str) -> str:
    return f"Here is my solution:\n{FENCE}python\n{body}\n{FENCE}\nDone."


# ---------------------------------------------------------------- math (math-verify)


@pytest.mark.parametrize(
    "completion,answer,expected",
    [
        ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
        ("We get $\\frac{2}{4}$", "\\frac{1}{2}", 1.0),
        ("Thus \\boxed{42}", "42", 1.0),
        ("Thus \\boxed{41}", "42", 0.0),
        ("The roots give \\boxed{x^2+1}", "1 + x^2", 1.0),
        ("I am not sure.", "42", 0.0),
        ("", "42", 0.0),
    ],
)
def test_math_correctness_uses_math_verify(completion, answer, expected):
    math = pytest.importorskip("rewards.math", reason="math-verify is not installed")
    assert math.correctness("q", completion, {"answer": answer}) == expected


def test_math_correctness_needs_a_gold_answer():
    math = pytest.importorskip("rewards.math", reason="math-verify is not installed")
    with pytest.raises(KeyError):
        math.correctness("q", "\\boxed{1}", {})


def test_math_correctness_in_a_worker_thread_runs_without_signals():
    math = pytest.importorskip("rewards.math", reason="math-verify is not installed")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math.correctness, "q", "\\boxed{7}", {"answer": "7"}).result(timeout=30) == 1.0


# ---------------------------------------------------------------- format


@pytest.mark.parametrize(
    "completion,expected",
    [
        ("answer: \\boxed{\\frac{1}{2}}", 1.0),
        ("\\fbox{3}", 1.0),
        ("\\boxed{}", 0.0),
        ("\\boxed{  }", 0.0),
        ("\\boxed{\\frac{1}{2}", 0.0),  # unbalanced
        ("the answer is 3", 0.0),
    ],
)
def test_boxed(completion, expected):
    assert format_reward.boxed("", completion, {}) == expected


def test_answer_tag():
    assert format_reward.answer_tag("", "think... <answer>\n42\n</answer>", {}) == 1.0
    assert format_reward.answer_tag("", "<answer> </answer>", {}) == 0.0
    assert format_reward.answer_tag("", "<answer>42", {}) == 0.0
    assert format_reward.answer_tag("", "<final>x</final>", {}, tag="final") == 1.0


def test_boxed_contents_handles_nesting():
    assert format_reward.boxed_contents("a \\boxed{\\frac{1}{\\sqrt{2}}} b \\boxed{3}") == ["\\frac{1}{\\sqrt{2}}", "3"]


# ---------------------------------------------------------------- length


@pytest.mark.parametrize("size,expected", [(0, 0.0), (10, 0.0), (11, -0.1), (15, -0.5), (20, -1.0), (50, -1.0)])
def test_length_penalty_in_chars_is_linear_then_capped(size, expected):
    assert length_reward.penalty("", "x" * size, {}, target=10) == pytest.approx(expected)


def test_length_penalty_in_tokens_window_and_meta_target():
    in_tokens = length_reward.penalty("", "", {"completion_tokens": 120}, target=100, unit="tokens", window=40)
    assert in_tokens == pytest.approx(-0.5)  # 20 tokens over, half of the 40-token window
    per_sample = length_reward.penalty("", "x" * 30, {"target_length": 20}, target=1000, max_penalty=2.0)
    assert per_sample == pytest.approx(-1.0)  # meta's target wins: 10 over a window of 20, times 2
    with pytest.raises(KeyError):
        length_reward.penalty("", "", {}, target=10, unit="tokens")
    with pytest.raises(ValueError):
        length_reward.penalty("", "abc", {})
    with pytest.raises(ValueError):
        length_reward.penalty("", "abc", {}, target=10, unit="words")


# ---------------------------------------------------------------- code (sandboxed)

ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]}


def test_extract_code_takes_the_first_python_block():
    text = f"{FENCE}bash\nls\n{FENCE}\n{FENCE}python\nx = 1\n{FENCE}\n{FENCE}py\ny = 2\n{FENCE}"
    assert code_reward.extract_code(text) == "x = 1\n"
    assert code_reward.extract_code("no code here") is None


def test_correct_solution_passes():
    out = code_reward.tests_pass("", solution("def add(a, b):\n    return a + b"), ADD_TESTS)
    assert out == {"reward": 1.0, "passed": 3.0, "total": 3.0, "timed_out": 0.0, "no_code": 0.0}


def test_wrong_solution_fails_and_partial_credit_is_a_fraction():
    multiplies = solution("def add(a, b):\n    return a * b")  # right only for add(2, 2)
    assert code_reward.tests_pass("", multiplies, ADD_TESTS)["reward"] == pytest.approx(1 / 3)
    assert code_reward.tests_pass("", multiplies, ADD_TESTS, all_or_nothing=True)["reward"] == 0.0
    assert code_reward.tests_pass("", solution("def add(a, b):\n    return 7"), ADD_TESTS)["reward"] == 0.0


@pytest.mark.parametrize(
    "body",
    [
        "import os\nos._exit(0)",  # exit early with success status
        "import sys\nsys.exit(0)",
        "raise RuntimeError('no')",
        "print('0' * 32, 'pass', 0)\nprint('pass 0')",  # forged pass lines without the nonce
        # read the nonce from the program file, forge every pass line, leave before the tests run
        "import os, re, sys\nsource = open(sys.argv[0]).read()\n"
        "nonce = re.search(r\"_k3post_harness\\('([0-9a-f]{32})'\", source).group(1)\n"
        "for i in range(3):\n    print(nonce, 'pass', i, flush=True)\nos._exit(0)",
    ],
)
def test_cheats_and_crashes_score_zero(body):
    assert code_reward.tests_pass("", solution(body), ADD_TESTS)["reward"] == 0.0


def test_a_main_block_does_not_run():
    body = "def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n    print(add(int(input()), 1))"
    assert code_reward.tests_pass("", solution(body), ADD_TESTS)["reward"] == 1.0


def test_no_code_block_and_missing_tests():
    assert code_reward.tests_pass("", "def add(a, b): return a + b", ADD_TESTS)["no_code"] == 1.0
    with pytest.raises(KeyError):
        code_reward.tests_pass("", solution("x = 1"), {})


def test_a_test_that_hangs_keeps_the_credit_earned_before_it():
    tests = {"tests": ["assert add(1, 2) == 3", "while True:\n    pass", "assert add(2, 2) == 4"]}
    out = code_reward.tests_pass("", solution("def add(a, b):\n    return a + b"), tests, timeout_s=1.0)
    assert out["timed_out"] == 1.0 and out["passed"] == 1.0 and out["reward"] == pytest.approx(1 / 3)
