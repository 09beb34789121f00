"""A teacher: scores the student's own tokens, samples its own answers for evaluation, and
computes exact KL terms against the student's full distributions.

Teachers share the student's tokenizer (checked at launch), so the student's token ids are
the teacher's too. A teacher with its own system prompt sees the prompt through it; the
completion tokens it scores are always the student's, unchanged.
"""

from __future__ import annotations

import torch

from k3post.algo.aggregate import masked_sum
from k3post.algo.opd import kl_divergence
from k3post.config.schema import TeacherSpec
from k3post.engine.common import engine_device, set_threads
from k3post.engine.sampler import vocab_fingerprint
from k3post.model.load import load_model
from k3post.model.logprobs import completion_full_logprobs, completion_logprobs
from k3post.model.sampling import decode_completions, render_prompts, sample_completions
from k3post.types import Prompt, Rollouts, SamplingParams


class TeacherScorer:
    def __init__(self, name: str, spec: TeacherSpec, num_threads: int | None = None):
        set_threads(num_threads)
        self.name, self.spec = name, spec
        self.model, self.tokenizer = load_model(spec.model)
        self.device = torch.device(engine_device(spec.resources))
        self.model.to(self.device)

    def _teacher_prompt_ids(self, rollouts: Rollouts) -> list[list[int]]:
        if self.spec.system_prompt is None:
            return rollouts.prompt_ids
        return render_prompts(self.tokenizer, rollouts.prompts, self.spec.system_prompt)

    @torch.no_grad()
    def score(self, rollouts: Rollouts) -> torch.Tensor:
        """log π_T(y_t | teacher's view of s_t) for every completion token, [B, T] (on the host)."""
        return completion_logprobs(self.model, self._teacher_prompt_ids(rollouts), rollouts.completion_ids_BT,
                                   rollouts.loss_mask_BT, self.tokenizer.pad_token_id, self.spec.temperature).cpu()

    def score_full(self, rollouts: Rollouts) -> torch.Tensor:
        """The teacher's whole next-token distribution at every completion position, [B, T, V] (on the host)."""
        return self._score_full(rollouts).cpu()

    @torch.no_grad()
    def _score_full(self, rollouts: Rollouts) -> torch.Tensor:
        return completion_full_logprobs(self.model, self._teacher_prompt_ids(rollouts), rollouts.completion_ids_BT,
                                        rollouts.loss_mask_BT, self.tokenizer.pad_token_id, self.spec.temperature)

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        """The teacher's own answers. `prompt_ids` hold the *student's* view of each prompt (the
        shared chat template without the teacher's system prompt), so the student can score them."""
        teacher_ids = render_prompts(self.tokenizer, prompts, self.spec.system_prompt)
        out = sample_completions(self.model, self.tokenizer, teacher_ids, params)
        texts = decode_completions(self.tokenizer, out)
        return Rollouts(prompts, render_prompts(self.tokenizer, prompts), out.completion_ids_BT, out.loss_mask_BT,
                        out.logprobs_BT, texts)

    def exact_kl(self, rollouts: Rollouts, student_logprobs_BTV: torch.Tensor, direction: str) -> dict[str, float]:
        """Σ_t of the exact per-position KL and the token count over `rollouts`.

        direction "reverse": KL(student‖teacher) — for the student's own samples;
        direction "forward": KL(teacher‖student) — for the teacher's samples.
        """
        teacher_BTV = self._score_full(rollouts)  # on this engine's device, like the sums below
        student_logprobs_BTV = student_logprobs_BTV.to(teacher_BTV.device)
        if direction == "reverse":
            kl_BT = kl_divergence(student_logprobs_BTV, teacher_BTV)
        elif direction == "forward":
            kl_BT = kl_divergence(teacher_BTV, student_logprobs_BTV)
        else:
            raise ValueError(f"direction must be 'reverse' or 'forward', got {direction!r}")
        mask = rollouts.loss_mask_BT.to(kl_BT.device)
        return {"kl_sum": float(masked_sum(kl_BT, mask)), "tokens": float(mask.sum())}

    def vocab_fingerprint(self) -> tuple[int, str]:
        return vocab_fingerprint(self.tokenizer)
