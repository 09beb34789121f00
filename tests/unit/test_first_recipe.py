"""A user's first own recipe (issue 21): a held-out file, `validate` opening every data file with
the overrides of `run`, pre-rendered prompts warned about, the student's system prompt as a recipe
key, every held-out prompt evaluated by default, the held-out trend warning."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from k3post.cli.main import main
from k3post.config.errors import UserError
from k3post.config.load import load_recipe
from k3post.config.schema import EvalSpec
from k3post.data.mixture import PromptMixture, PromptSource
from k3post.data.sources import load_source_rows
from k3post.loops.evaluate import RisingHeldOut

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny.yaml"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def own_recipe(tmp_path: Path, train_rows: int = 10, heldout_rows: int = 3, heldout_line: str | None = None) -> Path:
    """The issue's first recipe, on tiny models: one source with a training file and a held-out file."""
    write_jsonl(tmp_path / "train.jsonl", [{"id": f"t{i}", "prompt": f"Say {i}."} for i in range(train_rows)])
    write_jsonl(tmp_path / "heldout.jsonl", [{"id": f"h{i}", "prompt": f"Name {i}."} for i in range(heldout_rows)])
    source = heldout_line or "heldout_prompts: heldout.jsonl"
    text = SMOKE.read_text().replace("../teachers/", str(REPO / "recipes" / "teachers") + "/")
    text = text.replace('    - {name: chat, prompts: "builtin:chat", teacher: alpha, heldout: 4}\n'
                        '    - {name: math, prompts: "builtin:math", teacher: beta, heldout: 4}\n',
                        f"    - {{name: mine, prompts: train.jsonl, teacher: alpha, {source}}}\n")
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    return path


def test_a_heldout_file_is_exactly_the_heldout_set(tmp_path):
    recipe = load_recipe(own_recipe(tmp_path))
    source = recipe.data.sources[0]
    rows = load_source_rows(source.prompts, source.heldout_prompts, tmp_path)
    mixture = PromptMixture([PromptSource("mine", rows, "alpha", heldout=source.heldout)], seed=0)
    assert sorted(p.uid for p in mixture.heldout("mine")) == ["mine/h0", "mine/h1", "mine/h2"]
    trained = {p.uid for p in mixture.next_batch(40)}
    assert trained == {f"mine/t{i}" for i in range(10)}  # every training row, no held-out one


def test_a_heldout_row_that_is_also_trained_on_is_refused(tmp_path):
    recipe = load_recipe(own_recipe(tmp_path))
    write_jsonl(tmp_path / "heldout.jsonl", [{"id": "t3", "prompt": "Say 3."}])
    source = recipe.data.sources[0]
    with pytest.raises(UserError, match=r"heldout.jsonl: row 0: id 't3' is also a row of the training file"):
        load_source_rows(source.prompts, source.heldout_prompts, tmp_path)


def test_heldout_and_a_heldout_file_together_are_refused(tmp_path):
    with pytest.raises(UserError, match="not both"):
        load_recipe(own_recipe(tmp_path, heldout_line="heldout: 2, heldout_prompts: heldout.jsonl"))


def test_validate_opens_the_data_and_reports_the_split(tmp_path, capsys):
    assert main(["validate", str(own_recipe(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "data mine: " in out and "10 training rows, held out: 3 rows of " in out and "fields: messages" in out


def test_validate_fails_where_run_would(tmp_path, capsys):
    # heldout >= the rows of the file: "ok" before issue 21, an error only at run.
    assert main(["validate", str(own_recipe(tmp_path, train_rows=4, heldout_line="heldout: 4"))]) == 1
    assert "leaves no training rows" in capsys.readouterr().err
    assert main(["validate", str(own_recipe(tmp_path))]) == 0
    (tmp_path / "heldout.jsonl").unlink()
    assert main(["validate", str(tmp_path / "mine.yaml")]) == 1
    assert "prompt file not found" in capsys.readouterr().err


def test_validate_takes_the_overrides_of_run(tmp_path, capsys):
    path = str(own_recipe(tmp_path))
    assert main(["validate", path, "train.steps=3", "--recipe-only", "optim.lr=1e-5"]) == 0
    assert main(["validate", path, "optim.lr=-1"]) == 1
    assert "optim.lr" in capsys.readouterr().err


def test_prompts_that_look_rendered_are_warned_about(tmp_path, capsys):
    path = own_recipe(tmp_path)
    write_jsonl(tmp_path / "train.jsonl", [{"id": "a", "prompt": "<|im_start|>user\nHi<|im_end|>\n"},
                                           {"id": "b", "prompt": "Hello"}])
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "1 of 5 rows contain chat-template tokens ('<|im_start|>' in row 0)" in out and "already rendered" in out


def test_the_students_system_prompt_is_rendered_by_the_sampler(tiny_spec):
    from k3post.engine.samplers.sampler import HFSampler
    from k3post.launch.engines import sampler_spec
    from k3post.model.generation.sampling import render_prompts
    from k3post.types import Prompt, SamplingParams

    recipe = load_recipe(SMOKE, ["sampling.system_prompt=Answer in one word."])
    assert sampler_spec(recipe).kwargs["system_prompt"] == "Answer in one word."
    assert load_recipe(SMOKE).sampling.system_prompt is None  # default: the chat template decides
    prompts = [Prompt(uid="s/1", source="s", teacher="t", messages=(("user", "Hi"),))]
    plain, told = HFSampler(tiny_spec), HFSampler(tiny_spec, system_prompt="Answer in one word.")
    params = SamplingParams(2, 1.0, 1.0, seed=0)
    assert plain.sample(prompts, params).prompt_ids == render_prompts(plain.tokenizer, prompts)
    with_system = told.sample(prompts, params).prompt_ids
    assert with_system == render_prompts(told.tokenizer, prompts, "Answer in one word.")
    assert with_system != render_prompts(told.tokenizer, prompts)
    assert "Answer in one word." in told.tokenizer.decode(with_system[0])


def test_every_heldout_prompt_is_evaluated_by_default():
    """eval.prompts_per_source defaults to None: the loops slice each source's held-out rows
    `[:None]`, i.e. all of them (16 by default, not 8 as before)."""
    from k3post.loops.distill import prepare

    recipe = load_recipe(SMOKE, ["eval.prompts_per_source=null"])
    assert EvalSpec().prompts_per_source is None and recipe.eval.prompts_per_source is None
    rows = load_source_rows("builtin:chat", None, REPO)
    data = PromptMixture([PromptSource(s.name, rows, s.teacher, heldout=s.heldout) for s in recipe.data.sources], 0)
    run = SimpleNamespace(recipe=recipe, run_dir=Path("/nonexistent"), learner=None, data=data, say=print,
                          weight_sync=SimpleNamespace(push=lambda step: None))
    _, heldout = prepare(run)
    assert len(heldout.prompts) == sum(s.heldout for s in recipe.data.sources) == 8


def test_a_heldout_kl_rising_at_two_evaluations_in_a_row_is_warned_once():
    said: list[str] = []
    trend = RisingHeldOut()
    for step, kl in [(0, 0.075), (10, 0.07), (20, 0.09), (30, 0.141), (40, 0.15), (50, 0.12), (60, 0.13)]:
        trend.check(step, {"eval/kl/chat": kl, "eval/fkl/chat": 1.0, "time/eval_s": 1.0}, said.append)
    assert len(said) == 1  # at step 30 (0.07 → 0.09 → 0.141), not again at 40, nor after the fall at 50
    assert "eval/kl/chat rose at 2 evaluations in a row" in said[0] and "(step 30)" in said[0]
    assert "optim.lr" in said[0]


def test_a_resume_may_change_the_sinks_and_the_heldout_prompts_evaluated(tmp_path):
    """Neither changes a training result: a run saved before issue 21 (eval.prompts_per_source: 8
    written out, no track key) resumes under the new defaults, and with other sinks."""
    from k3post.config.load import load_run_recipe
    from k3post.track.run_dir import prepare_run_dir
    from tests.unit.test_run_dir import RECIPE, run_dir_with

    saved = load_run_recipe(RECIPE, ["eval.prompts_per_source=null"]).model_dump(mode="json")
    del saved["track"]
    saved["eval"]["prompts_per_source"] = 8
    run_dir = run_dir_with(tmp_path, saved)
    prepare_run_dir(load_run_recipe(RECIPE, ["eval.prompts_per_source=null"]), run_dir, restart=False)
    prepare_run_dir(load_run_recipe(RECIPE, ["track=[{kind: jsonl}]"]), run_dir, restart=False)
    with pytest.raises(UserError, match=r"changed: sampling\.system_prompt"):
        prepare_run_dir(load_run_recipe(RECIPE, ["sampling.system_prompt=Be brief."]), run_dir, restart=False)
