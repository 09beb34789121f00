"""A reward model as an engine: a sequence classifier scoring (prompt, completion) pairs in batches.

No Ray here (docs/architecture.md): the Ray backend makes it an actor group with its own resources, like a
teacher. Each pair is rendered as the conversation the policy had — the prompt's messages plus
the completion as the assistant's turn — through the classifier's own chat template (plain
"prompt\\n\\ncompletion" text if it has none), so the classifier need not share the policy's
tokenizer: it reads text, not token ids.
"""

from __future__ import annotations

import torch

from k3post.config.schema import RewardModelSpec
from k3post.engine.common import engine_device, set_threads
from k3post.model.loading.classifier import load_classifier
from k3post.types import Prompt


class RewardModelScorer:
    def __init__(self, name: str, spec: RewardModelSpec, num_threads: int | None = None):
        set_threads(num_threads)
        self.name, self.spec = name, spec
        self.model, self.tokenizer = load_classifier(spec)
        self.device = engine_device(spec.resources)  # "cuda" when its resources ask for a GPU
        self.model.to(self.device)

    def render(self, prompt: Prompt, completion: str) -> str:
        chat = prompt.as_chat() + [{"role": "assistant", "content": completion}]
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return "\n\n".join(m["content"] for m in chat)

    @torch.no_grad()
    def score(self, prompts: list[Prompt], completions: list[str]) -> list[float]:
        """The classifier's logit of `spec.label` for each pair, in input order, `batch_size` at a time."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        texts = [self.render(p, c) for p, c in zip(prompts, completions)]
        scores: list[float] = []
        for start in range(0, len(texts), self.spec.batch_size):
            batch = self.tokenizer(texts[start:start + self.spec.batch_size], return_tensors="pt", padding=True,
                                   truncation=True, max_length=self.spec.max_length, add_special_tokens=False)
            logits_BL = self.model(input_ids=batch["input_ids"].to(self.device),
                                   attention_mask=batch["attention_mask"].to(self.device)).logits
            scores.extend(logits_BL[:, self.spec.label].float().tolist())
        return scores
