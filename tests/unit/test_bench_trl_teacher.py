"""bench/alternatives/bench_trl.py's SystemPromptTeacher: fed TRL's left-padded rows (the student's
view, its template's default system turn), it returns at every completion position the
distribution that k3post's teacher computes from its own view (the teacher's system prompt) - so
the TRL arm of bench/alternatives/opd_vs_alternatives.py distils from the same teacher as the
k3post arms."""

from __future__ import annotations

import torch

from k3post.model.scoring.logprobs import completion_full_logprobs
from k3post.model.generation.sampling import render_prompts
from k3post.types import Prompt

SYSTEM = "Always begin your reply with the word 'Answer:'."


def test_teacher_logits_match_the_teachers_own_view(tiny_model, monkeypatch):
    from bench.alternatives.bench_trl import SystemPromptTeacher  # noqa: PLC0415

    model, tokenizer = tiny_model
    prompts = [Prompt("a", "s", "t", (("user", "Hi there, how are you?"),)), Prompt("b", "s", "t", (("user", "Why?"),))]
    student_ids = render_prompts(tokenizer, prompts)
    g = torch.Generator().manual_seed(0)
    completion_BT = torch.randint(5, len(tokenizer) - 1, (2, 5), generator=g)
    lengths = [5, 3]  # row b: a completion of 3 tokens, then right padding
    width = max(len(p) for p in student_ids)
    pad = tokenizer.pad_token_id
    rows, masks = [], []
    for ids, n, completion in zip(student_ids, lengths, completion_BT.tolist()):
        left = width - len(ids)  # TRL: prompts left-padded, completions after them
        rows.append([pad] * left + ids + completion[:n] + [pad] * (5 - n))
        masks.append([0] * left + [1] * (len(ids) + n) + [0] * (5 - n))
    input_ids, attention_mask = torch.tensor(rows), torch.tensor(masks)

    with torch.no_grad():
        out = SystemPromptTeacher(model, tokenizer, SYSTEM)(input_ids=input_ids, attention_mask=attention_mask).logits
        mask_BT = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
        expected_BTV = completion_full_logprobs(model, render_prompts(tokenizer, prompts, SYSTEM), completion_BT,
                                                mask_BT, pad)
    for b, n in enumerate(lengths):
        for t in range(n):  # the logits at column width - 1 + t predict completion token t
            got = torch.log_softmax(out[b, width - 1 + t].float(), -1)
            assert torch.allclose(got, expected_BTV[b, t], atol=1e-4), (b, t)
    plain_out = model(input_ids=torch.tensor([student_ids[0] + completion_BT[0].tolist()])).logits[0]
    plain = torch.log_softmax(plain_out[len(student_ids[0]) - 1], -1)
    assert not torch.allclose(plain, expected_BTV[0, 0], atol=1e-4)  # the system prompt does change it
