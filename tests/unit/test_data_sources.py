"""Built-in prompt sets and loading prompt rows from files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from k3post.config.errors import UserError
from k3post.data.builtin_prompts import builtin_prompt_set
from k3post.data.sources import load_prompt_rows


# --- built-in sets ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["chat", "math"])
def test_builtin_set_is_large_unique_and_deterministic(name):
    rows = builtin_prompt_set(name)
    assert len(rows) >= 240
    assert len({r["id"] for r in rows}) == len(rows)
    assert len({r["prompt"] for r in rows}) == len(rows)
    assert all(re.fullmatch(rf"{name}-\d{{4}}", r["id"]) for r in rows)
    assert all(0 < len(r["prompt"]) < 200 for r in rows)
    assert builtin_prompt_set(name) == rows


def test_chat_set_has_varied_shapes():
    # The first three words stand in for the template: at least 8 distinct openings.
    openings = {" ".join(r["prompt"].split()[:3]) for r in builtin_prompt_set("chat")}
    assert len(openings) >= 8


def _expected_math_answer(prompt: str) -> str:
    """Re-derive the answer from the prompt text, independently of the generator."""
    nums = [int(x) for x in re.findall(r"\d+", prompt)]
    if "even or odd" in prompt:
        return "even" if nums[0] % 2 == 0 else "odd"
    a, b = nums
    if "+" in prompt or "buys" in prompt:
        return str(a + b)
    if " - " in prompt or "gives" in prompt:
        return str(a - b)
    if "times" in prompt or "box holds" in prompt:
        return str(a * b)
    if "divided by" in prompt or "shares" in prompt:
        assert a % b == 0, prompt
        return str(a // b)
    raise AssertionError(f"unrecognised math prompt: {prompt}")


def test_math_answers_are_correct():
    rows = builtin_prompt_set("math")
    for row in rows:
        assert row["answer"] == _expected_math_answer(row["prompt"]), row
    kinds = {"+", " - ", "times", "divided", "buys", "gives", "box holds", "shares", "even or odd"}
    assert all(any(k in r["prompt"] for r in rows) for k in kinds)


def test_unknown_builtin_lists_known_names(tmp_path):
    with pytest.raises(UserError, match="chat, math"):
        load_prompt_rows("builtin:poems", tmp_path)


def test_builtin_spec_normalises_rows(tmp_path):
    rows = load_prompt_rows("builtin:math", tmp_path)
    assert rows[0]["id"] == "math-0001"
    assert rows[0]["messages"] == [("user", builtin_prompt_set("math")[0]["prompt"])]
    assert rows[0]["answer"] == builtin_prompt_set("math")[0]["answer"]
    assert "prompt" not in rows[0]


# --- files ------------------------------------------------------------------------------------

def _write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


ROWS = [
    {"id": "a", "prompt": "Hi there?", "answer": "1"},
    {"prompt": "No id here."},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]},
]


def _check_rows(rows: list[dict], stem: str) -> None:
    assert [r["id"] for r in rows] == ["a", f"{stem}-1", f"{stem}-2"]
    assert rows[0]["messages"] == [("user", "Hi there?")] and rows[0]["answer"] == "1"
    assert rows[2]["messages"] == [("system", "Be brief."), ("user", "Why?")]


def test_jsonl_relative_to_base_dir(tmp_path):
    (tmp_path / "data").mkdir()
    _write_jsonl(tmp_path / "data" / "p.jsonl", ROWS)
    _check_rows(load_prompt_rows("data/p.jsonl", tmp_path), "p")


def test_json_list(tmp_path):
    (tmp_path / "q.json").write_text(json.dumps(ROWS), encoding="utf-8")
    _check_rows(load_prompt_rows("q.json", tmp_path), "q")


def test_parquet(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"id": "a", "prompt": "Hi there?", "answer": "1"},
            {"id": None, "prompt": "No id here.", "answer": None}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "r.parquet"))
    loaded = load_prompt_rows(str(tmp_path / "r.parquet"), Path("/nonexistent"))
    assert [r["id"] for r in loaded] == ["a", "r-1"]
    assert loaded[1]["messages"] == [("user", "No id here.")]


def test_parquet_messages(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"messages": [{"role": "user", "content": "Why?"}]}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "m.parquet"))
    assert load_prompt_rows("m.parquet", tmp_path)[0]["messages"] == [("user", "Why?")]


@pytest.mark.parametrize(
    "bad_row, expected",
    [
        ({"text": "no prompt"}, "expected a string field 'prompt' or a list field 'messages'"),
        ({"prompt": 7}, "expected a string field 'prompt'"),
        ({"messages": []}, "'messages'"),
        ({"messages": [{"role": "user"}]}, "messages[0]: expected an object with string fields"),
        (["not", "an", "object"], "instead of an object"),
        ({"id": 1.5, "prompt": "x"}, "field 'id'"),
    ],
)
def test_bad_row_names_file_and_row(tmp_path, bad_row, expected):
    _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "ok"}] * 12 + [bad_row])
    with pytest.raises(UserError) as err:
        load_prompt_rows("prompts.jsonl", tmp_path)
    assert "prompts.jsonl: row 12" in str(err.value)
    assert expected in str(err.value)


def test_invalid_json_line_names_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "ok"}\n\n{"prompt": oops}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"p\.jsonl: line 3 \(row 1\): invalid JSON"):
        load_prompt_rows("p.jsonl", tmp_path)


def test_invalid_json_file_names_line(tmp_path):
    (tmp_path / "p.json").write_text('[\n{"prompt": "ok"},\n{"prompt" "x"}\n]', encoding="utf-8")
    with pytest.raises(UserError, match=r"p\.json: line 3: invalid JSON"):
        load_prompt_rows("p.json", tmp_path)


def test_missing_file_names_resolved_path(tmp_path):
    with pytest.raises(UserError) as err:
        load_prompt_rows("nope/missing.jsonl", tmp_path)
    msg = str(err.value)
    assert "missing.jsonl" in msg and "not found" in msg
    assert str((tmp_path / "nope" / "missing.jsonl").resolve()) in msg


def test_empty_file(tmp_path):
    (tmp_path / "e.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"e\.jsonl: no rows"):
        load_prompt_rows("e.jsonl", tmp_path)


def test_duplicate_ids_name_both_rows(tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", [{"id": "x", "prompt": "a"}, {"id": "x", "prompt": "b"}])
    with pytest.raises(UserError, match=r"d\.jsonl: row 1: duplicate id 'x' \(first used by row 0\)"):
        load_prompt_rows("d.jsonl", tmp_path)


def test_unsupported_suffix(tmp_path):
    (tmp_path / "p.csv").write_text("prompt\nhi\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"p\.csv: unsupported file type.*\(got '\.csv'\)"):
        load_prompt_rows("p.csv", tmp_path)
