"""The reward-model engine: a sequence classifier scoring (prompt, completion) pairs in batches."""

from __future__ import annotations

import pytest
import torch

from k3post.config.errors import UserError
from k3post.config.schema import RewardModelSpec, TinyModelSpec
from k3post.engine.evaluation.reward_model import RewardModelScorer
from k3post.model.loading.classifier import save_tiny_classifier
from k3post.types import Prompt

TINY = TinyModelSpec(hidden_size=32, num_layers=2, seed=5)
PROMPTS = [Prompt(f"s/{i}", "s", "", (("user", q),)) for i, q in enumerate(["What is 2+2?", "Name a colour.", "Hi"])]
ANSWERS = ["4", "Blue, or maybe a very dark shade of green, or red.", "Hello there!"]


def test_batched_scores_equal_one_at_a_time_and_a_manual_forward():
    scorer = RewardModelScorer("rm", RewardModelSpec(tiny=TINY, batch_size=3))
    batched = scorer.score(PROMPTS, ANSWERS)
    alone = [scorer.score([p], [a])[0] for p, a in zip(PROMPTS, ANSWERS)]
    assert batched == pytest.approx(alone, abs=1e-5)  # padding does not change a score
    assert len(set(round(x, 6) for x in batched)) == 3  # and the scores depend on the input
    # The score is the classifier's logit of the last token of the rendered conversation.
    text = scorer.render(PROMPTS[1], ANSWERS[1])
    assert text.endswith("<|im_start|>assistant\n" + ANSWERS[1] + "<|im_end|>\n")
    ids = torch.tensor([scorer.tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        manual = scorer.model(input_ids=ids).logits[0, 0].item()
    assert batched[1] == pytest.approx(manual, abs=1e-5)


def test_any_hf_classifier_directory_scores_like_the_spec_it_was_saved_from(tmp_path):
    directory = save_tiny_classifier(TINY, tmp_path / "rm")
    from_dir = RewardModelScorer("rm", RewardModelSpec(path=str(directory), batch_size=2))
    from_spec = RewardModelScorer("rm", RewardModelSpec(tiny=TINY))
    assert from_dir.score(PROMPTS, ANSWERS) == pytest.approx(from_spec.score(PROMPTS, ANSWERS), abs=1e-5)


def test_long_inputs_keep_their_end():
    scorer = RewardModelScorer("rm", RewardModelSpec(tiny=TINY, max_length=16))
    long_prompt = Prompt("s/9", "s", "", (("user", "x" * 500),))
    short_prompt = Prompt("s/8", "s", "", (("user", "y" * 300),))
    # Only the last 16 tokens are read: the end of the completion decides, the long prompts do not.
    a, b = scorer.score([long_prompt, short_prompt], ["the same ending", "the same ending"])
    assert a == pytest.approx(b, abs=1e-5)


def test_bad_reward_models_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        RewardModelScorer("rm", RewardModelSpec(path=str(tmp_path)))
    with pytest.raises(UserError, match="label 3"):
        RewardModelScorer("rm", RewardModelSpec(tiny=TINY, label=3))
