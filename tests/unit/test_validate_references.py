"""`k3post validate` checks what a recipe names beyond its schema: each reward function exists
(`rewards.<module>:<function>` imports and has that function) and each `builtin:<name>` prompt set
is one k3post ships. A typo fails here, naming the file, the key path and the nearest names - not at
`run`, after Ray started, with a message naming neither. Through the CLI, as a user runs it: a
shipped recipe copied into a directory and broken there."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3post.cli.main import main
from k3post.config.errors import UserError

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "recipes" / "rl" / "smollm2-boxed.yaml"


def broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    text = SHIPPED.read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "recipe.yaml"
    path.write_text(text.replace(old, new), encoding="utf-8")
    return path


CASES = [
    ("rewards.math:correctness", "rewards.math:corectness", "data.sources[0].rewards[0].fn",
     "did you mean 'rewards.math:correctness'"),
    ("rewards.format:boxed", "rewards.formt:boxed", "data.sources[0].rewards[1].fn",
     "did you mean 'rewards.format:boxed'"),
    ('"builtin:math"', '"builtin:maths"', "data.sources[0].prompts", "did you mean 'builtin:math'"),
]


@pytest.mark.parametrize("old, new, key, hint", CASES, ids=["function", "module", "builtin"])
@pytest.mark.parametrize("flags", [[], ["--recipe-only"]], ids=["full", "recipe-only"])
def test_validate_names_the_file_the_key_and_the_nearest_name(tmp_path, monkeypatch, capsys, old, new, key, hint,
                                                              flags):
    path = broken_copy(tmp_path, old, new)
    monkeypatch.chdir(tmp_path)
    assert main(["validate", *flags, str(path)]) == 1
    out, err = capsys.readouterr()
    assert "0 valid, 1 invalid" in out
    assert f"INVALID {path}: {key}: " in err and hint in err, err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]  # no run directory, nothing written


def test_the_shipped_recipe_itself_validates(tmp_path, monkeypatch, capsys):
    """The check passes what is right (else the cases above would prove nothing)."""
    path = broken_copy(tmp_path, "kind: rl", "kind: rl")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", "--recipe-only", str(path)]) == 0
    assert "1 valid, 0 invalid" in capsys.readouterr().out


def test_run_checks_the_same_before_anything_starts(tmp_path, monkeypatch):
    """`k3post run`'s input check (cli/inputs.py: check_inputs, before Ray and the run directory)
    raises the same located error, before it loads a tokenizer or reads a model."""
    from k3post.cli.inputs import check_inputs
    from k3post.config.load import load_run_recipe

    path = broken_copy(tmp_path, "rewards.math:correctness", "rewards.math:corectness")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"recipe\.yaml: data\.sources\[0\]\.rewards\[0\]\.fn: .*did you mean"):
        check_inputs(load_run_recipe(path), path)


def test_submit_checks_them_before_contacting_a_cluster(tmp_path, monkeypatch, capsys):
    """`k3post submit --dry-run` (no cluster contacted either way) stops at the misnamed reward."""
    path = broken_copy(tmp_path, "rewards.math:correctness", "rewards.math:corectness")
    monkeypatch.chdir(tmp_path)
    assert main(["submit", "--dry-run", str(path.name)]) == 2
    err = capsys.readouterr().err
    assert "recipe.yaml: data.sources[0].rewards[0].fn: " in err and "did you mean 'rewards.math:correctness'" in err
    assert "dry run" not in err and sorted(p.name for p in tmp_path.iterdir()) == ["recipe.yaml"]


def copy_tree_broken(tmp_path: Path, relative: str, old: str, new: str) -> Path:
    """recipes/ copied (paths between recipes are relative) with one file broken."""
    import shutil

    shutil.copytree(REPO / "recipes", tmp_path / "recipes")
    path = tmp_path / "recipes" / relative
    text = path.read_text(encoding="utf-8")
    assert old in text
    path.write_text(text.replace(old, new), encoding="utf-8")
    return tmp_path / "recipes"


@pytest.mark.parametrize("old, new, key, hint", [
    ('data: "builtin:arith"', 'data: "builtin:arithh"', "tasks[0].data", "did you mean 'builtin:arith'"),
    ("verifier: math,", "verifier: rewards.math:corectness,", "tasks[0].verifier",
     "did you mean 'rewards.math:correctness'"),
], ids=["builtin", "verifier"])
def test_an_eval_recipes_tasks_are_checked_at_validate_and_at_eval(tmp_path, monkeypatch, capsys, old, new, key,
                                                                   hint):
    recipes = copy_tree_broken(tmp_path, "eval/smoke-tiny.yaml", old, new)
    path = recipes / "eval" / "smoke-tiny.yaml"
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(path)]) == 1
    assert f"INVALID {path}: {key}: " in capsys.readouterr().err
    assert main(["eval", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: {key}: " in err and hint in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_a_pipeline_checks_every_stage_recipe_before_its_first_stage_runs(tmp_path, monkeypatch, capsys):
    recipes = copy_tree_broken(tmp_path, "smoke/tiny.yaml", '"builtin:math"', '"builtin:maths"')
    path = recipes / "pipelines" / "smoke-tiny.yaml"
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(path)]) == 1
    assert "stages[1].recipe: stage 'opd': " in capsys.readouterr().err
    assert main(["run", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "data.sources[1].prompts: unknown built-in prompt set 'maths'; did you mean 'builtin:math'" in err
    assert not (tmp_path / "run").exists()  # the SFT stage before it never started
