"""The HF teacher's prompt-prefix cache end to end (engine/teachers/teacher_prefix.py): its head is a
prefix of every rendered prompt, its scores equal the uncached teacher's (every scoring method),
its counts reach the metrics, a changed system prompt is never served the old keys, and the
context-distillation recipe that relies on it loads."""

from __future__ import annotations

import pytest
import torch
import transformers

from k3post.algo.text_metrics import BRIEF_WORDS, brief
from k3post.config.load import load_recipe
from k3post.config.schema import ModelSpec, TeacherSpec, TinyModelSpec
from k3post.data.eval_sets import STYLE_OPENING, load_eval_rows
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.engine.teachers.teacher_prefix import TeacherPrefix, template_head
from k3post.loops.routing import prefix_metrics
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.model.scoring.prefix_scoring import hidden_logprobs
from k3post.model.generation.sampling import render_prompts
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.types import Prompt, Rollouts
from rewards.style import opens_with
from tests.unit.test_family_parity import tiny_config

TOL = 1e-5
MODEL = ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))
QUESTIONS = ["what is two plus two", "name a colour", "what is two plus two", "say hello"]


def rollouts_for(teacher: TeacherScorer, system: str | None) -> Rollouts:
    prompts = [Prompt(str(i), "s", "t", (("user", q),)) for i, q in enumerate(QUESTIONS)]
    g = torch.Generator().manual_seed(0)
    ids_BT = torch.randint(5, teacher.model.config.vocab_size, (len(prompts), 6), generator=g)
    mask_BT = (torch.arange(6)[None, :] < torch.tensor([6, 4, 5, 2])[:, None]).float()
    return Rollouts(prompts, render_prompts(teacher.tokenizer, prompts, system), ids_BT * mask_BT.long(), mask_BT,
                    torch.zeros_like(mask_BT))


def teachers(system: str | None) -> tuple[TeacherScorer, TeacherScorer]:
    spec = TeacherSpec(model=MODEL, system_prompt=system)
    return TeacherScorer("t", spec), TeacherScorer("t", spec.model_copy(update={"prefix_cache": False}))


def test_the_template_head_starts_every_rendered_prompt():
    cached, _ = teachers("Answer briefly. " * 20)
    rows = rollouts_for(cached, cached.spec.system_prompt).prompt_ids
    head = template_head(cached.tokenizer, cached.spec.system_prompt)
    assert len(head) > 40 and all(row[:len(head)] == head and len(row) > len(head) for row in rows)


def test_cached_teacher_scores_equal_the_uncached_ones_and_are_counted():
    system = "Answer briefly. " * 20
    cached, whole = teachers(system)
    rollouts = rollouts_for(cached, None)  # the student's view: the teacher renders its own
    assert float((cached.score(rollouts) - whole.score(rollouts)).abs().max()) <= TOL
    assert float((cached.score_full(rollouts) - whole.score_full(rollouts)).abs().max()) <= TOL
    a_BT, a_topk = cached.score_topk(rollouts, 4)
    b_BT, b_topk = whole.score_topk(rollouts, 4)
    assert float((a_BT - b_BT).abs().max()) <= TOL and torch.allclose(a_topk.logprobs_BTK, b_topk.logprobs_BTK,
                                                                      atol=TOL)
    a_BT, a_hidden = cached.score_with_hidden(rollouts)
    b_BT, b_hidden = whole.score_with_hidden(rollouts)
    assert float((a_BT - b_BT).abs().max()) <= TOL
    assert float((a_hidden.hidden_BTH - b_hidden.hidden_BTH).abs().max()) <= 1e-4
    head = len(cached.prefix.ids)
    counts, plain = cached.prefix_counts(), whole.prefix_counts()
    rows = rollouts_for(cached, system).prompt_ids
    total = 4 * sum(len(r) for r in rows)  # four scoring calls
    # each call: the head of every row reused, and the repeated question's rest once more
    repeat = len(rows[2]) - head
    assert counts["prompt_tokens"] == plain["prompt_tokens"] == total
    assert counts["prompt_tokens_encoded"] == total - 4 * (4 * head + repeat)
    assert plain["prompt_tokens_encoded"] == total and cached.prefix.store.builds == 1
    metrics = prefix_metrics(counts, "t")
    assert metrics["teacher/prefix_tokens_reused/t"] == 4 * (4 * head + repeat)
    assert metrics["teacher/score_seconds/t"] > 0 and cached.prefix_counts() == {}


def test_a_resumed_teacher_with_another_system_prompt_scores_with_the_new_one():
    old, new = "Answer briefly. " * 20, "Answer at length, with examples. " * 12
    first, _ = teachers(old)
    rollouts = rollouts_for(first, None)
    before = first.score(rollouts)
    resumed, resumed_whole = teachers(new)
    after = resumed.score(rollouts)
    assert float((after - resumed_whole.score(rollouts)).abs().max()) <= TOL
    assert float((after - before).abs().max()) > 1e-3  # the prompts score differently: this can fail
    assert resumed.prefix.store.kv.ids == tuple(template_head(resumed.tokenizer, new))


def test_the_context_distillation_recipe_loads_with_a_long_guide_and_a_measurable_rule():
    """The guide is long, its first rule is brevity (which the 135M teacher follows), and the eval
    scores it with `brief`; the opening rule's reward and set still load for teachers that follow it."""
    recipe = load_recipe("recipes/distill/context-distill.yaml")
    teacher = recipe.teachers["style"]
    assert recipe.sampling.system_prompt is None and teacher.prefix_cache
    assert len(teacher.system_prompt.split()) > 250 and "never more than ten words" in teacher.system_prompt
    evaluation = load_recipe("recipes/eval/context-distill.yaml")
    assert [(t.kind, getattr(t, "score", None)) for t in evaluation.tasks] == [("text", "brief"), ("kl", None)]
    assert brief("The compiler checks the types before the program runs.") == 1.0
    assert brief("word " * (BRIEF_WORDS + 1)) == 0.0
    rows, _ = load_eval_rows("builtin:style-chat", ".", None, None, None)
    assert rows and all(r["answer"] == STYLE_OPENING for r in rows)
    assert opens_with("", "  in short: water boils at 70 °C there.", {"answer": STYLE_OPENING}) == 1.0
    assert opens_with("", "Sure! In short: yes.", {"answer": STYLE_OPENING}) == 0.0


def windowed_model(model_type: str, window: int | None):
    """A tiny model of the family, with its sliding window cut to `window` tokens when given."""
    tokenizer = build_tiny_tokenizer()
    config = tiny_config(model_type, tokenizer)
    if window is not None:
        config.sliding_window = window
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval(), tokenizer


@pytest.mark.parametrize("model_type, layers", [("gemma2", "layers 0 of 2"), ("mistral", "all 2 layers")])
def test_a_sliding_window_teacher_says_at_start_which_layers_slide_and_falls_back_past_it(capsys, model_type,
                                                                                          layers):
    """Sliding-window layers take the cache only while every row fits the window: the teacher says
    so once at start (which layers, the window), then scores a batch that passes the window
    whole (all rows counted as fallbacks) and one inside it from the cache, both equal to the
    uncached forward."""
    system = "Be brief. "
    tokenizer = build_tiny_tokenizer()
    prompts = [Prompt(str(i), "s", "t", (("user", q),)) for i, q in enumerate(QUESTIONS)]
    rows = render_prompts(tokenizer, prompts, system)
    longest = max(len(r) for r in rows)
    model, _ = windowed_model(model_type, longest + 8)
    prefix = TeacherPrefix("w", model, tokenizer, True, system)
    said = capsys.readouterr().out
    assert said.count("k3post: teacher 'w'") == 1 and layers in said, said
    assert f"sliding window of {longest + 8} tokens" in said
    assert len(template_head(tokenizer, system)) < min(len(r) for r in rows)
    for new_tokens, fallback in ((8, 0), (9, len(rows))):  # the longest row at the window, then one past it
        g = torch.Generator().manual_seed(0)
        ids_BT = torch.randint(5, model.config.vocab_size, (len(rows), new_tokens), generator=g)
        mask_BT = torch.ones_like(ids_BT, dtype=torch.float)
        with torch.no_grad():
            want_BT = completion_logprobs(model, rows, ids_BT, mask_BT, tokenizer.pad_token_id)
            got_BT = hidden_logprobs(model, prefix.hidden_states(rows, ids_BT, mask_BT, tokenizer.pad_token_id),
                                     ids_BT, mask_BT)
        counts = prefix.take_counts()
        assert counts["fallback_rows"] == fallback, (new_tokens, counts)
        assert (counts["prompt_tokens_encoded"] < counts["prompt_tokens"]) == (fallback == 0)
        assert float((got_BT - want_BT).abs().max()) <= TOL, (model_type, new_tokens)


def test_a_teacher_without_sliding_layers_says_nothing_at_start(capsys):
    model, tokenizer = windowed_model("llama", None)
    TeacherPrefix("w", model, tokenizer, True, "Answer briefly.")
    assert "k3post: teacher" not in capsys.readouterr().out
