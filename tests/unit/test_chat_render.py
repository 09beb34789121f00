"""ChatRenderer: the shared head of a chat template tokenized once, every row's ids equal to the
whole rendering's (model/scoring/chat_render.py)."""

from __future__ import annotations

import pytest
from k3post.config.schema import ModelSpec
from k3post.model.scoring.chat_render import ChatRenderer
from k3post.model.loading.load import load_tokenizer
from k3post.model.generation.sampling import render_prompts
from k3post.model.loading.tiny import build_tiny_tokenizer
from k3post.types import Prompt
from tests.tokenizer_fixtures import byte_level_bpe, metaspace_bpe

MESSAGES = ["What is 11 + 6?", " leading space", "\n\nnew lines first", "ends with a space ", "2026 naïve e\u0301 🎉",
            "日本語のテキスト", "<|im_end|> inside", "", "Tabs\tand  double  spaces", "hello world"]
SYSTEMS = [None, "You are a math tutor. Answer briefly.", " starts with a space", "Use metric units.\n\n" * 40]


def _prompts() -> list[Prompt]:
    prompts = [Prompt(f"p{i}", "s", "t", (("user", m),)) for i, m in enumerate(MESSAGES)]
    prompts.append(Prompt("own-system", "s", "t", (("system", "Its own system turn."), ("user", "Hi"))))
    prompts.append(Prompt("turns", "s", "t", (("user", "Hi"), ("assistant", "Hello."), ("user", "And 2 + 2?"))))
    return prompts


@pytest.fixture(scope="module")
def smollm2():
    return load_tokenizer(ModelSpec(builtin="smollm2-135m-instruct"))


def _tokenizers(smollm2):
    return {"smollm2": smollm2, "byte-level": byte_level_bpe(), "metaspace": metaspace_bpe(),
            "tiny-chars": build_tiny_tokenizer()}


@pytest.mark.parametrize("name", ["smollm2", "byte-level", "metaspace", "tiny-chars"])
@pytest.mark.parametrize("system", SYSTEMS, ids=["none", "short", "space", "long"])
def test_equals_the_whole_rendering(smollm2, name, system):
    tokenizer = _tokenizers(smollm2)[name]
    renderer = ChatRenderer(tokenizer)
    assert renderer(_prompts(), system) == render_prompts(tokenizer, _prompts(), system)


def test_the_head_is_taken_and_ends_at_a_special_token(smollm2):
    """The renderer does skip the head (else the equality above would hold trivially)."""
    renderer = ChatRenderer(smollm2)
    system = SYSTEMS[-1]
    head = renderer._head(system)
    assert head is not None and head.token == "<|im_start|>" and system in head.text
    assert len(head.ids) > 100  # the long system prompt is in the head, tokenized once
    calls = []
    real = renderer._ids
    renderer._ids = lambda texts: calls.append(texts) or real(texts)
    renderer(_prompts()[:3], system)
    assert len(calls) == 1 and all(system not in t and t.startswith("<|im_start|>") for t in calls[0])


def test_a_tokenizer_the_split_does_not_reproduce_renders_whole(smollm2, monkeypatch):
    """A head whose split would change the ids (here: the probes' reference made to differ) is not used."""
    import k3post.model.scoring.chat_render as chat_render

    monkeypatch.setattr(chat_render, "render_prompts",
                        lambda tokenizer, prompts, system=None: [[0] + ids for ids in render_prompts(tokenizer, prompts,
                                                                                                     system)])
    assert ChatRenderer(smollm2)._head("You are terse.") is None


def test_a_slow_tokenizer_renders_whole():
    """A Python tokenizer splits at special tokens its own way: no head is taken for it."""
    tokenizer = metaspace_bpe()
    assert ChatRenderer(tokenizer)._head("x") is not None
    tokenizer.__class__ = type("Slow", (type(tokenizer),), {"is_fast": property(lambda self: False)})
    renderer = ChatRenderer(tokenizer)
    assert renderer._head("x") is None
    assert renderer(_prompts(), "x") == render_prompts(tokenizer, _prompts(), "x")


def test_a_template_whose_head_changes_gets_a_new_head():
    """A head the rendering no longer starts with (a template that prints the date, or a new
    template) is made again on the next call, not left to render every row whole for the run."""
    tokenizer = byte_level_bpe()
    renderer = ChatRenderer(tokenizer)
    first = renderer._head("Be brief.")
    tokenizer.chat_template = "<|im_start|>Today: 6 Dec<|im_end|>\n" + tokenizer.chat_template
    assert renderer(_prompts(), "Be brief.") == render_prompts(tokenizer, _prompts(), "Be brief.")
    second = renderer._head("Be brief.")
    assert second is not None and second != first and second.text.startswith("<|im_start|>Today: 6 Dec")
