"""The policies behind the bad-input corpus (test_bad_input.py): the prompt-length policy, the
fallback past a broken checkpoint, bounded YAML that still reads legal YAML, shortened values."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import save_file

from k3post.cli.inputs import check_data
from k3post.config.bounded_yaml import MAX_ALIASES, load_yaml_text
from k3post.config.errors import RecipeError, UserError, shorten
from k3post.config.load import dump_recipe, load_run_recipe
from k3post.data.prompt_length import limit_prompt_lengths, prompt_tokens
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.track.atomic import latest_checkpoint, mark_complete
from k3post.track.run_dir import RESOLVED, prepare_run_dir

TOKENIZER = build_tiny_tokenizer()  # one id per character: lengths are easy to reason about
LONG = "x" * 500 + " the question?"


def rows() -> list[dict]:
    return [{"id": "short", "messages": [("user", "hi")]},
            {"id": "long", "messages": [("system", "Be brief."), ("user", "old"), ("assistant", "old reply"),
                                        ("user", LONG)]}]


def test_refuse_names_the_row_and_the_lengths():
    with pytest.raises(UserError, match=r"^p\.jsonl: row 1: the prompt is [\d,]+ tokens, more than "
                                        r"data\.max_prompt_tokens=64 \(data\.long_prompts is refuse"):
        limit_prompt_lengths(rows(), TOKENIZER, 64, "refuse", "p.jsonl")


def test_drop_leaves_the_row_out_and_counts_it():
    kept, report = limit_prompt_lengths(rows(), TOKENIZER, 64, "drop", "p.jsonl")
    assert [r["id"] for r in kept] == ["short"] and report.dropped == [1] and report.truncated == []


def test_truncate_left_keeps_the_system_prompt_and_the_end_of_the_last_turn():
    kept, report = limit_prompt_lengths(rows(), TOKENIZER, 64, "truncate_left", "p.jsonl")
    assert report.truncated == [1] and report.dropped == []
    messages = kept[1]["messages"]
    assert messages[0] == ("system", "Be brief.") and [r for r, _ in messages] == ["system", "user"]
    assert messages[-1][1].endswith("the question?") and len(messages[-1][1]) < len(LONG)
    assert prompt_tokens(TOKENIZER, messages) <= 64
    assert kept[0] == rows()[0]  # a row within the limit is untouched


def test_truncate_left_keeps_an_sft_reply_whole():
    example = {"id": "e", "messages": [("user", LONG), ("assistant", "the reply")]}
    kept, report = limit_prompt_lengths([example], TOKENIZER, 40, "truncate_left", "x.jsonl", sft=True)
    assert report.truncated == [0] and kept[0]["messages"][-1] == ("assistant", "the reply")
    assert prompt_tokens(TOKENIZER, kept[0]["messages"][:-1]) <= 40


def test_a_system_prompt_longer_than_the_limit_cannot_be_truncated():
    row = {"id": "s", "messages": [("system", "y" * 200), ("user", "q")]}
    with pytest.raises(UserError, match="row 0: .*system prompt and chat template alone exceed"):
        limit_prompt_lengths([row], TOKENIZER, 64, "truncate_left", "p.jsonl")


def test_dropping_every_row_is_an_error():
    with pytest.raises(UserError, match="every row is longer"):
        limit_prompt_lengths(rows()[1:], TOKENIZER, 64, "drop", "p.jsonl")


def test_check_data_applies_the_recipe_policy_and_reports_counts(tmp_path, monkeypatch):
    (tmp_path / "p.jsonl").write_text('{"prompt": "hi"}\n{"prompt": "' + "z" * 3000 + '"}\n{"prompt": "yo"}\n')
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "kind": "distill", "student": {"tiny": {"hidden_size": 32}}, "teachers": {"t": {"model": {"tiny": {}}}},
        "data": {"sources": [{"name": "s", "prompts": "p.jsonl", "teacher": "t", "heldout": 0}],
                 "max_prompt_tokens": 100, "long_prompts": "drop"}}))
    monkeypatch.chdir(tmp_path)
    checked = check_data(load_run_recipe(recipe_file))
    assert [r["id"] for r in checked.rows["s"]] == ["p-0", "p-2"]
    assert checked.metrics() == {"data/long_prompts_dropped/s": 1, "data/long_prompts_truncated/s": 0}


def _checkpoint(path: Path, weights: bool) -> None:
    path.mkdir(parents=True)
    if weights:
        save_file({"w": torch.ones(3)}, str(path / "model.safetensors"))
    (path / "run_state.json").write_text("{}")
    mark_complete(path)


def test_a_complete_checkpoint_without_weights_is_set_aside_and_the_previous_one_used(tmp_path, capsys):
    recipe = load_run_recipe(Path(__file__).resolve().parents[2] / "recipes" / "smoke" / "tiny.yaml")
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints" / "step-1", weights=True)
    _checkpoint(run / "checkpoints" / "step-2", weights=False)
    _checkpoint(run / "checkpoints" / "step-3", weights=True)
    (run / "checkpoints" / "step-3" / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{}")  # cut short
    (run / RESOLVED).write_text(dump_recipe(recipe))
    assert latest_checkpoint(run / "checkpoints")[0] == 3  # the marker alone would resume from step 3
    prepare_run_dir(recipe, run, restart=False)
    err = capsys.readouterr().err
    assert f"{run / 'checkpoints' / 'step-3'} is marked complete but cannot be resumed from" in err
    assert f"{run / 'checkpoints' / 'step-2'} is marked complete" in err and "no weight files" in err
    assert latest_checkpoint(run / "checkpoints") == (1, run / "checkpoints" / "step-1")
    assert (run / "checkpoints" / ".step-3.broken").is_dir() and (run / "checkpoints" / ".step-2.broken").is_dir()


def test_bounded_yaml_still_reads_merges_and_a_few_aliases():
    text = "base: &b {lr: 1, wd: 0}\noptim:\n  <<: *b\n  lr: 2\nagain: *b\n"
    assert load_yaml_text(text, Path("r.yaml")) == {"base": {"lr": 1, "wd": 0}, "optim": {"lr": 2, "wd": 0},
                                                    "again": {"lr": 1, "wd": 0}}
    many = "a: &a 1\nb: [" + ", ".join(["*a"] * (MAX_ALIASES + 1)) + "]\n"
    with pytest.raises(RecipeError, match=rf"r\.yaml: line 2: more than {MAX_ALIASES} aliases"):
        load_yaml_text(many, Path("r.yaml"))


def test_shorten_cuts_long_values_and_does_not_expand_big_containers():
    assert shorten("abc") == "'abc'"
    assert shorten("x" * 1000).endswith("… (1002 characters)") and len(shorten("x" * 1000)) < 120
    assert shorten(list(range(10**6))) == "a list of 1000000 items"


def test_the_policy_counts_reach_step_0_of_metrics_jsonl(tmp_path):
    """A run that drops a long prompt logs how many, per source, with its first row."""
    from k3post.cli.run import run_recipe
    from k3post.track.metrics import read_metrics

    repo = Path(__file__).resolve().parents[2]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"r{i}", "prompt": "hello " * (400 if i == 3 else 3)})
                                 for i in range(12)) + "\n")
    recipe = yaml.safe_load((repo / "recipes/smoke/tiny.yaml").read_text())
    recipe["teachers"] = {k: str(repo / "recipes/smoke" / v) for k, v in recipe["teachers"].items()}
    recipe["data"]["sources"][0]["prompts"] = str(prompts)
    recipe["data"].update(max_prompt_tokens=1000, long_prompts="drop")  # the character tokenizer: 2,400 > 1,000
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert run_recipe(path, ["train.steps=1"], tmp_path / "run", in_process=True, restart=False) == 0
    first = read_metrics(tmp_path / "run" / "metrics.jsonl")[0]
    assert first["step"] == 0 and first["data/long_prompts_dropped/chat"] == 1
    assert first["data/long_prompts_dropped/math"] == 0 and first["data/long_prompts_truncated/chat"] == 0
