"""Model cards (issue 21): FP8 exports carry one (the checkpoint's, tagged fp8), `k3post eval
--card` appends its tables to a student's card, and a card is a Hub model card that tools parse."""

from __future__ import annotations

from pathlib import Path

import yaml
from huggingface_hub import ModelCard

from k3post.cli.main import main
from k3post.config.load import load_recipe
from k3post.config.schema import TinyModelSpec
from k3post.model.loading.tiny import save_tiny
from k3post.track.model_card import CARD_FILE, model_card

REPO = Path(__file__).resolve().parents[2]
TINY = {"hidden_size": 32, "num_layers": 1}
QUICKSTART = load_recipe(REPO / "recipes" / "quickstart.yaml").model_dump(mode="json")
EVAL = {"eval/kl/chat": 0.574, "eval/kl/math": 0.503, "eval/fkl/chat": 0.81, "eval/fkl/math": 0.77,
        "time/eval_s": 31.0}
BEFORE = {"eval/kl/chat": 0.918, "eval/kl/math": 0.884, "eval/fkl/chat": 0.987, "eval/fkl/math": 1.034}


def checkpoint_with_card(path: Path) -> Path:
    save_tiny(TinyModelSpec(**TINY, seed=6), path)
    (path / CARD_FILE).write_text(model_card(QUICKSTART, 28, EVAL, BEFORE), encoding="utf-8")
    return path


def test_a_card_is_a_hub_card_with_base_model_teachers_data_and_figures():
    card = ModelCard(model_card(QUICKSTART, 28, EVAL, BEFORE))
    data = card.data.to_dict()
    assert data["base_model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and data["library_name"] == "transformers"
    assert {"on-policy-distillation", "multi-teacher-distillation"} <= set(data["tags"])
    assert [t["name"] for t in data["teachers"]] == ["chat", "math"]
    assert data["datasets"] == ["builtin:chat", "builtin:math"]
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {k: v for k, v in EVAL.items()
                                                                              if k.startswith("eval/")}
    assert "| reverse KL(student‖teacher chat) on the student's samples, nats/token (`eval/kl/chat`) | 0.918 | " \
           "0.574 |" in card.text
    assert "system prompt: 'You are a patient math tutor." in card.text  # the math teacher's own
    assert "model-index" not in model_card(QUICKSTART, 0)  # no evaluation yet: no results claimed


def test_the_fp8_export_carries_the_checkpoints_card_tagged_fp8(tmp_path, capsys):
    ckpt = checkpoint_with_card(tmp_path / "step-28")
    assert main(["export-fp8", str(ckpt), str(tmp_path / "fp8")]) == 0, capsys.readouterr().err
    card = ModelCard((tmp_path / "fp8" / CARD_FILE).read_text(encoding="utf-8"))
    data = card.data.to_dict()
    assert {"fp8", "on-policy-distillation"} <= set(data["tags"]) and data["base_model_relation"] == "quantized"
    assert [t["name"] for t in data["teachers"]] == ["chat", "math"]
    assert "## FP8 export" in card.text and "Linear layers in FP8 e4m3" in card.text
    save_tiny(TinyModelSpec(**TINY, seed=6), tmp_path / "bare")  # a checkpoint without a card gets one too
    assert main(["export-fp8", str(tmp_path / "bare"), str(tmp_path / "fp8-bare")]) == 0
    bare = ModelCard((tmp_path / "fp8-bare" / CARD_FILE).read_text(encoding="utf-8")).data.to_dict()
    assert "fp8" in bare["tags"] and bare["base_model"] == str(tmp_path / "bare")


def test_eval_card_appends_the_students_results(tmp_path, capsys):
    ckpt = checkpoint_with_card(tmp_path / "student")
    recipe = tmp_path / "eval.yaml"
    recipe.write_text(yaml.safe_dump({
        "kind": "eval", "students": {"mine": {"model": {"path": str(ckpt)}}},
        "teachers": {"alpha": str(REPO / "recipes" / "teachers" / "tiny-alpha.yaml")},
        "tasks": [{"name": "kl", "kind": "kl", "prompts": "builtin:heldout-chat", "limit": 2}],
        "sampling": {"max_new_tokens": 4, "batch_size": 4}, "seed": 7}))
    assert main(["eval", str(recipe), "--out", str(tmp_path / "report"), "--card"]) == 0, capsys.readouterr().err
    text = (ckpt / CARD_FILE).read_text(encoding="utf-8")
    card = ModelCard(text)
    assert card.data.to_dict()["teachers"][0]["name"] == "chat"  # the front matter is kept
    assert "## Evaluation: k3post eval eval.yaml" in card.text and "| mine |" in card.text
    assert "## Held-out evaluation (step 28)" in card.text  # the training run's section is still there
