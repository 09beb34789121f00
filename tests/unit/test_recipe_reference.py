"""docs/reference/recipes.md, the recipe key reference, is generated from the schema
(k3post/config/reference.py): every key of every recipe kind has a description, the page is what
the generator writes, and a few known keys show their true defaults and bounds."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3post.config import reference
from k3post.config.kinds import RECIPE_KINDS

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "reference" / "recipes.md"


@pytest.fixture(scope="module")
def rows() -> dict[str, dict[str, reference.Row]]:
    """kind → key path → row (for a key of several `kind` variants, the first)."""
    out: dict[str, dict[str, reference.Row]] = {}
    for kind, kind_rows in reference.all_rows().items():
        out[kind] = {}
        for row in kind_rows:
            out[kind].setdefault(row.path, row)
    return out


def test_every_recipe_kind_has_a_section():
    assert [kind for kind, _, _ in reference.KINDS] == ["distill", "sft", "rl", "pipeline", "eval", "teacher"]
    assert set(reference.recipe_models()) == {*RECIPE_KINDS, "eval", "pipeline"}


def test_every_key_of_every_recipe_kind_has_a_description():
    missing = [f"{kind}: {row.path}" for kind, kind_rows in reference.all_rows().items()
               for row in kind_rows if not row.description.strip()]
    assert not missing, (f"{len(missing)} recipe keys have no description; give each field "
                         f"Field(..., description=\"...\") in k3post/config/:\n" + "\n".join(missing))


def test_the_page_is_what_the_generator_writes():
    assert PAGE.is_file(), f"{PAGE} is missing; write it with `{reference.COMMAND}`"
    assert PAGE.read_text(encoding="utf-8") == reference.render(), (
        f"docs/reference/recipes.md is stale (the recipe schema changed); regenerate it with `{reference.COMMAND}`")


def test_check_flag_exits_1_on_a_stale_page_and_0_on_a_fresh_one(tmp_path, capsys):
    stale = tmp_path / "recipes.md"
    stale.write_text(reference.render().replace("| `loss.kl_coef` |", "| `loss.kl_coeff` |"), encoding="utf-8")
    assert reference.main(["--check", "--page", str(stale)]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and reference.COMMAND in err and "loss.kl_coeff" in err
    stale.write_text(reference.render(), encoding="utf-8")
    assert reference.main(["--check", "--page", str(stale)]) == 0


def test_the_output_is_deterministic():
    assert reference.render() == reference.render()


@pytest.mark.parametrize("kind, path, default, allowed", [
    ("distill", "loss.kl_coef", "`1.0`", "> 0"),
    ("distill", "train.steps", "`40`", "> 0"),
    ("distill", "loss.kind", "`sampled_token`", "`sampled_token`, `full_vocab`"),
    ("distill", "loss.teacher_answers.prompts_per_step", "required", "> 0"),
    ("distill", "data.sources[].teacher", "required", ""),
    ("distill", "data.sources[].heldout", "`16`", "≥ 0"),
    ("distill", "teachers.<name>.loss.k", "`64`", "> 0"),
    ("distill", "teachers.<name>.loss.beta", "`0.5`", "≥ 0; ≤ 1"),
    ("distill", "optim.lr", "`5e-05`", "> 0"),
    ("distill", "sampling", "its keys' defaults", ""),
    ("distill", "track", "`[{kind: tensorboard}]`", "by `kind`: `jsonl`, `tensorboard`, `wandb`, `mlflow`"),
    ("rl", "sampling.n", "`4`", "≥ 2"),
    ("rl", "loss.clip_low", "`0.2`", "> 0; < 1"),
    ("sft", "data.examples_per_step", "`8`", "> 0"),
    ("sft", "data.long_prompts", "`refuse`", "`refuse`, `truncate_left`, `drop`"),
    ("pipeline", "stages[].overrides", "`[]`", ""),
    ("eval", "tasks[].k", "`[1]`", "at least 1 item; each item > 0"),
    ("teacher", "temperature", "`1.0`", "> 0"),
    ("teacher", "model.kimi.tokenizer_from", "required", ""),
])
def test_known_keys_show_their_defaults_and_bounds(rows, kind, path, default, allowed):
    row = rows[kind][path]
    assert (row.default, row.allowed) == (default, allowed)
    assert f"| `{path}` |" in PAGE.read_text(encoding="utf-8")


def test_recursive_model_specs_name_their_enclosing_section(rows):
    assert rows["distill"]["student.kimi.tokenizer_from"].type == "mapping (the keys of `student`)"
    assert "student.kimi.tokenizer_from.builtin" not in rows["distill"]


def test_a_discriminated_list_has_one_table_per_kind():
    text = reference.render()
    for kind in ("generation", "kl", "nll", "fp8_gap", "text"):
        assert f"### `tasks[]` with `kind: {kind}`" in text
    assert text.count("### `track[]` with `kind: wandb`") == 4  # distill, sft, rl, eval


def test_placeholders_render_as_code():
    assert reference._cell("builtin:<name> or a file") == "`builtin:<name>` or a file"
    assert reference._cell("topk_*: k | `a|b`") == "topk_\\*: k \\| `a\\|b`"
