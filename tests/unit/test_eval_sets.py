"""The shipped eval sets, the verifiers they are scored with, and the eval recipe loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3post.config.errors import RecipeError
from k3post.config.eval_load import load_eval_recipe
from k3post.config.eval_schema import GenerationTask
from k3post.data.builtin_prompts import builtin_prompt_set
from k3post.data.eval_sets import builtin_eval_set, eval_set_names, load_eval_rows
from rewards import code as code_reward
from rewards.match import exact_match, regex_match
from rewards.math import correctness
from tests.unit.test_architecture import REPO


def test_shipped_sets_are_deterministic_sized_and_uniquely_identified():
    sizes = {"arith": 300, "code": 40, "reference": 200, "heldout-chat": 120, "style-chat": 120}
    assert eval_set_names() == sorted(sizes)
    for name, size in sizes.items():
        rows = builtin_eval_set(name)
        assert len(rows) == size and rows == builtin_eval_set(name)
        assert len({r["id"] for r in rows}) == size and len({r["prompt"] for r in rows}) == size
    assert all(r["answer"].isdigit() for r in builtin_eval_set("arith"))
    training = {r["prompt"] for r in builtin_prompt_set("math")} | {r["prompt"] for r in builtin_prompt_set("chat")}
    for name in ("arith", "heldout-chat", "reference", "style-chat"):
        assert not training & {r["prompt"] for r in builtin_eval_set(name)}, name


def test_arith_gold_answers_verify_and_wrong_ones_do_not():
    for row in builtin_eval_set("arith")[::15]:
        meta = {"answer": row["answer"]}
        assert correctness(row["prompt"], f"Let me think. The answer is {row['answer']}.", meta) == 1.0
        assert correctness(row["prompt"], f"The answer is {int(row['answer']) + 1}.", meta) == 0.0


@pytest.mark.parametrize("index, solution", [
    (0, "def add(a, b):\n    return a + b\n"),
    (11, "def multiply_by_3(x):\n    return x * 3\n"),
    (33, "def remainder_5(x):\n    return x % 5\n"),
])
def test_code_tasks_pass_with_a_correct_solution_only(index, solution):
    row = builtin_eval_set("code")[index]
    assert row["entry_point"] in solution
    right = code_reward.tests_pass(row["prompt"], f"```python\n{solution}```", row, all_or_nothing=True)
    wrong = code_reward.tests_pass(row["prompt"], f"```python\n{solution.replace('return', 'return 1 +')}```", row,
                       all_or_nothing=True)
    assert (right["reward"], wrong["reward"]) == (1.0, 0.0)


def test_exact_and_regex_match():
    assert exact_match("", "  Paris. ", {"answer": "paris"}) == 1.0
    assert exact_match("", "Paris is the answer", {"answer": "Paris"}) == 0.0
    assert exact_match("", "B", {"answer": ["A", "B"]}) == 1.0
    # The last match counts: a model that mentions 3 before settling on 5 answered 5.
    assert regex_match("", "maybe 3... no: 5", {"answer": "5"}) == 1.0
    assert regex_match("", "maybe 5... no: 3", {"answer": "5"}) == 0.0
    assert regex_match("", "Answer: Blue", {"gold": "blue"}, pattern=r"answer: (\w+)", field="gold") == 1.0
    assert regex_match("", "no number here", {"answer": "5"}) == 0.0


def test_file_rows_load_through_the_prompt_loader(tmp_path):
    (tmp_path / "qa.jsonl").write_text('{"id": "a", "prompt": "hi", "answer": "1"}\n')
    rows, label = load_eval_rows("qa.jsonl", tmp_path)
    assert rows == [{"id": "a", "messages": [("user", "hi")], "answer": "1"}] and label == str(tmp_path / "qa.jsonl")


def write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_loader_keeps_valid_entries_and_reports_the_rest(tmp_path):
    (tmp_path / "sub").mkdir()
    path = write(tmp_path / "sub" / "eval.yaml", {
        "kind": "eval",
        "students": {"a": {"model": {"path": "models/a"}}, "b": {"model": {"tiny": {}}, "run": "x"},
                     "r": {"run": "../runs/q", "fp8": "export"}},
        "teachers": {"t": str(REPO / "recipes" / "teachers" / "tiny-alpha.yaml")},
        "tasks": [{"name": "ok", "kind": "generation", "data": "rows.jsonl", "verifier": "exact", "samples": 2,
                   "k": [1, 2]},
                  {"name": "k3", "kind": "generation", "data": "builtin:arith", "k": [3]},
                  {"name": "kl", "kind": "kl", "prompts": "builtin:heldout-chat", "teachers": ["nobody"]},
                  {"name": "odd", "kind": "rouge"}],
    })
    loaded = load_eval_recipe(path, ["seed=3"])
    recipe = loaded.recipe
    assert recipe.seed == 3 and list(recipe.students) == ["a", "r"] and [t.name for t in recipe.tasks] == ["ok"]
    assert recipe.students["a"].model.path == str(tmp_path / "sub" / "models" / "a")  # relative to the recipe
    assert recipe.students["r"].run == str(tmp_path / "runs" / "q") and recipe.students["r"].fp8 == "export"
    task = recipe.tasks[0]
    assert isinstance(task, GenerationTask) and task.data == str(tmp_path / "sub" / "rows.jsonl")
    errors = {p["entry"]: p["error"] for p in loaded.problems}
    assert set(errors) == {"tasks[1]", "tasks[2]", "tasks[3]", "students.b"}
    assert "k 3 > samples 1" in errors["tasks[1]"] and "nobody" in errors["tasks[2]"]
    assert errors["tasks[3]"].startswith(f"{path}: tasks[3].kind: unknown task type 'rouge'")
    with pytest.raises(RecipeError, match="unknown task type 'rouge'"):
        load_eval_recipe(path, strict=True)
