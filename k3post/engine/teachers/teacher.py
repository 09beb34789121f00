"""A teacher: scores the student's own tokens, samples its own answers for evaluation, and
computes exact KL terms against the student's full distributions.

A teacher built here shares the student's tokenizer (decided at launch: launch/compat_checks.py),
so the student's token ids are the teacher's too; a teacher with another tokenizer wraps this
engine in engine/teachers/cross_teacher.py, which hands it the teacher's own ids. A teacher with its own system prompt or its own chat
template renders the prompt itself from the rollout's messages; the completion tokens it scores
are always the student's, unchanged.
"""

from __future__ import annotations

import copy

import torch

from k3post.algo.aggregate import masked_sum
from k3post.algo.opd import kl_divergence
from k3post.algo.topk import complement_logsumexp
from k3post.config.errors import UserError
from k3post.config.schema import TeacherSpec
from k3post.engine.common import engine_device, set_threads
from k3post.engine.samplers.sampler import vocab_fingerprint
from k3post.engine.teachers.teacher_prefix import TeacherPrefix
from k3post.model.scoring.chat_render import ChatRenderer
from k3post.model.families import model_logit_transform
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import hidden_full_logprobs
from k3post.model.scoring.prefix_scoring import hidden_logprobs
from k3post.model.generation.sampling import decode_completions, render_prompts, sample_completions
from k3post.model.tokenizers.token_text import TokenText
from k3post.types import Prompt, Rollouts, SamplingParams, TeacherFull, TeacherHidden, TeacherTopK


def token_logprobs_from(full_BTV: torch.Tensor, rollouts: Rollouts) -> torch.Tensor:
    """log π_T(y_t) of the sampled tokens, read off the full distributions, [B, T] (0 at pads)."""
    ids_BT1 = rollouts.completion_ids_BT.to(full_BTV.device)[..., None]
    return full_BTV.gather(-1, ids_BT1).squeeze(-1) * rollouts.loss_mask_BT.to(full_BTV.device)


class TeacherScorer:
    def __init__(self, name: str, spec: TeacherSpec, num_threads: int | None = None,
                 student_template: str | None = None, student_system_prompt: str | None = None):
        """`student_template`: given when the student's chat template differs from this teacher's
        (same vocabulary, checked at launch): the teacher then renders every prompt itself, from the
        rollout's messages, through its own template (with its own system prompt, else the
        student's `student_system_prompt`), and renders the student's view of its own answers
        through the student's template."""
        set_threads(num_threads)
        self.name, self.spec = name, spec
        self.model, self.tokenizer = load_model(spec.model)
        self.render = ChatRenderer(self.tokenizer)  # the system turn tokenized once, not every row
        self.device = torch.device(engine_device(spec.resources))
        self.model.to(self.device)
        self.own_template, self.student_system_prompt = student_template is not None, student_system_prompt
        self.student_view = self.tokenizer
        self._text: TokenText | bool | None = None  # the tokens' bytes, for the per-byte held-out KL (made on first use)
        if self.own_template:  # the same vocabulary with the student's template: the student's ids
            self.student_view = copy.copy(self.tokenizer)
            self.student_view.chat_template = student_template
        # The system prompt the rows it scores carry: its own, else the student's (rendered by
        # the sampler, or by this teacher through its own template).
        system = spec.system_prompt if spec.system_prompt is not None else student_system_prompt
        self.prefix = TeacherPrefix(name, self.model, self.tokenizer, spec.prefix_cache, system)

    def _teacher_prompt_ids(self, rollouts: Rollouts) -> list[list[int]]:
        if self.spec.system_prompt is None and not self.own_template:
            return rollouts.prompt_ids
        system = self.spec.system_prompt if self.spec.system_prompt is not None else self.student_system_prompt
        return self.render(rollouts.prompts, system)

    def _hidden(self, rollouts: Rollouts) -> torch.Tensor:
        """The final hidden states [B, T, H] that predict the completion tokens (engine/teachers/teacher_prefix.py:
        after the cached prefix, each distinct prompt once; equal to the uncached forward)."""
        return self.prefix.hidden_states(self._teacher_prompt_ids(rollouts), rollouts.completion_ids_BT,
                                         rollouts.loss_mask_BT, self.tokenizer.pad_token_id)

    @torch.no_grad()
    def score(self, rollouts: Rollouts) -> torch.Tensor:
        """log π_T(y_t | teacher's view of s_t) for every completion token, [B, T] (on the host)."""
        with self.prefix.timed():
            return hidden_logprobs(self.model, self._hidden(rollouts), rollouts.completion_ids_BT,
                                   rollouts.loss_mask_BT, self.spec.temperature).cpu()

    def score_full(self, rollouts: Rollouts) -> torch.Tensor:
        """The teacher's whole next-token distribution at every completion position, [B, T, V] (on the host)."""
        with self.prefix.timed():
            return self._score_full(rollouts).cpu()

    @torch.no_grad()
    def _score_full(self, rollouts: Rollouts) -> torch.Tensor:
        return hidden_full_logprobs(self.model, self._hidden(rollouts), self.spec.temperature)

    def prefix_counts(self) -> dict[str, float]:
        """Prompt tokens scored and encoded, rows that fell back, scoring seconds: since the last call."""
        return self.prefix.take_counts()

    # -- scores for per-teacher losses: ([B, T] logprobs of the sampled tokens, for the driver;
    # a payload, for the learner). On Ray they are two return values: the driver fetches the first
    # and hands the second to the learner by reference (ray/groups.py).

    @torch.no_grad()
    def score_topk(self, rollouts: Rollouts, k: int) -> tuple[torch.Tensor, TeacherTopK]:
        """The sampled tokens' logprobs [B, T] and, at every position, the teacher's top-k ids
        [B, T, k] (int32), their logprobs [B, T, k] and its exact tail logprob [B, T] (the
        logsumexp of its complement: no 1 − Σ cancellation)."""
        with self.prefix.timed():
            full_BTV = self._score_full(rollouts)
            values_BTK, ids_BTK = full_BTV.topk(min(k, full_BTV.shape[-1]), dim=-1)
            tail_BT = complement_logsumexp(full_BTV, ids_BTK)
            topk = TeacherTopK(ids_BTK.int().cpu(), values_BTK.float().cpu(), tail_BT.float().cpu())
            return token_logprobs_from(full_BTV, rollouts).cpu(), topk

    def score_with_full(self, rollouts: Rollouts) -> tuple[torch.Tensor, TeacherFull]:
        """The sampled tokens' logprobs [B, T] and the whole distributions [B, T, V]."""
        with self.prefix.timed():
            full_BTV = self._score_full(rollouts)
            return token_logprobs_from(full_BTV, rollouts).cpu(), TeacherFull(full_BTV.cpu())

    @torch.no_grad()
    def score_with_hidden(self, rollouts: Rollouts) -> tuple[torch.Tensor, TeacherHidden]:
        """The sampled tokens' logprobs [B, T] and the final hidden states [B, T, H] they come
        from (H floats a position instead of V: the learner applies `output_head()`)."""
        with self.prefix.timed():
            h_BTH = self._hidden(rollouts)
            logits_BTV = (h_BTH @ self.model.get_output_embeddings().weight.T).float()
            logits_BTV = model_logit_transform(self.model)(logits_BTV) / self.spec.temperature
            token_BT = token_logprobs_from(logits_BTV.log_softmax(-1), rollouts)
            return token_BT.cpu(), TeacherHidden(h_BTH.float().cpu(), self.spec.temperature)

    def output_head(self) -> torch.Tensor:
        """The output head W [V, H] (logits = h Wᵀ), sent to the learner once: teachers are frozen.

        A family's logit scale (Granite, Cohere: z ↦ s·z) is folded in, s·W, so the learner's
        h (s·W)ᵀ is the family's logits exactly. A soft-cap (Gemma) is not linear in W and the
        learner's chunked KL has no place for it: such a teacher is refused for
        `send: hidden_states` (this is called once, at launch)."""
        transform = model_logit_transform(self.model)
        if transform.softcap is not None:
            raise UserError(f"teachers.{self.name}.loss.send: hidden_states needs logits linear in the hidden state, "
                            f"but this {self.model.config.model_type} teacher soft-caps its logits "
                            f"(final_logit_softcapping {transform.softcap}); use send: logprobs for it")
        return (self.model.get_output_embeddings().weight.detach().float() * transform.scale).cpu()

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        """The teacher's own answers. `prompt_ids` hold the *student's* view of each prompt (the
        shared chat template without the teacher's system prompt), so the student can score them."""
        teacher_ids = self.render(prompts, self.spec.system_prompt)
        out = sample_completions(self.model, self.tokenizer, teacher_ids, params)
        texts = decode_completions(self.tokenizer, out)
        return Rollouts(prompts, render_prompts(self.student_view, prompts), out.completion_ids_BT, out.loss_mask_BT,
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
        ids_BT1 = rollouts.completion_ids_BT.to(kl_BT.device)[..., None]
        ratio_BT = (student_logprobs_BTV.gather(-1, ids_BT1) - teacher_BTV.gather(-1, ids_BT1)).squeeze(-1)
        ratio_BT = ratio_BT if direction == "reverse" else -ratio_BT
        out = {"kl_sum": float(masked_sum(kl_BT, mask)), "tokens": float(mask.sum())}
        text_bytes = self._bytes(rollouts)
        if text_bytes is not None:
            out.update(seq_logratio_sum=float(masked_sum(ratio_BT.double(), mask)), bytes=float(text_bytes))
        return out

    def _bytes(self, rollouts: Rollouts) -> int | None:
        """The bytes of text of the completions (model/tokenizers/token_text.py; special tokens are none), or
        None for a slow tokenizer, whose tokens' bytes cannot be read."""
        if self._text is None:
            try:
                self._text = TokenText(self.tokenizer)
            except UserError:
                self._text = False
        if self._text is False:
            return None
        return sum(len(b"".join(self._text.pieces(ids[: int(mask.sum())].tolist())))
                   for ids, mask in zip(rollouts.completion_ids_BT, rollouts.loss_mask_BT))

    def vocab_fingerprint(self) -> tuple[int, str]:
        return vocab_fingerprint(self.tokenizer)

    def check_scores(self, rollouts: Rollouts) -> dict[str, float] | None:
        """The drift gate's teacher spot check (loops/drift_gate.py): how far this engine's scores
        are from an HF recomputation. This engine *is* the HF computation: nothing to compare."""
        return None
