"""A teacher that scores the student's tokens with vLLM (`engine: vllm` in its YAML).

Sampled-token scores, top-k scores (`prompt_logprobs=k`) and the teacher's own answers come from
vLLM. Its top-k tail is 1 − Σ_k p (algo/topk.py: tail_from_topk), as vLLM sends no more.

Full distributions and hidden states (exact-KL evaluations, the spot check of `check_scores`)
come from an HF copy of the teacher made on first use **on the CPU**, whatever the actor holds:
vLLM returns top-k logprobs, not the whole vocabulary, and on a GPU the engine has taken
`gpu_memory_utilization` of the device already, so a second copy there runs out of memory at the
step-0 evaluation. The teacher is frozen, so the copy never needs a weight sync; it costs one
model's worth of host memory and a CPU forward per evaluation batch. A *training* loss that needs
the whole distribution every step (full_vocab) on a GPU teacher is refused at launch
(launch/distill.py): a CPU forward every step would be the run's bottleneck; use engine: hf.
"""

from __future__ import annotations

import torch

from k3post.algo.topk import tail_from_topk
from k3post.config.loss_schema import TOPK_KINDS
from k3post.config.schema import TeacherSpec
from k3post.engine.common import set_threads
from k3post.engine.samplers.sampler import vocab_fingerprint
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.engine.vllm.sleep import Sleeper
from k3post.engine.vllm.vllm_engine import build_llm, generate, token_logprobs, topk_prompt_logprobs
from k3post.model.generation.sampling import decode_completions, eos_ids
from k3post.model.loading.load import generation_config, load_tokenizer
from k3post.model.scoring.chat_render import ChatRenderer
from k3post.types import Prompt, Rollouts, SamplingParams, TeacherFull, TeacherHidden, TeacherTopK


def merge_score_checks(checks: list[dict[str, float] | None]) -> dict[str, float] | None:
    """One answer from several replicas' `check_scores`: the largest max and the mean of the means
    (each replica checks rows of its own; one without tokens to check answers None)."""
    found = [c for c in checks if c is not None]
    if not found:
        return None
    return {"max_abs_diff": max(c["max_abs_diff"] for c in found),
            "mean_abs_diff": sum(c["mean_abs_diff"] for c in found) / len(found)}


class VLLMTeacher:
    full_engine = TeacherScorer  # what computes full distributions (an HF copy on the CPU, made on first use)
    CHECK_ROWS = 2  # rows of a batch that `check_scores` recomputes on the HF copy

    def __init__(self, name: str, spec: TeacherSpec, num_threads: int | None = None, max_logprobs: int | None = None):
        """`max_logprobs`: the most top-k ids it will be asked for (default: its top-k loss's k)."""
        set_threads(num_threads)
        self.name, self.spec = name, spec
        self.tokenizer = load_tokenizer(spec.model)
        self.render = ChatRenderer(self.tokenizer)
        topk = spec.loss is not None and spec.loss.kind in TOPK_KINDS
        self.llm = build_llm(spec.model, spec.vllm, max_logprobs=max_logprobs or (spec.loss.k if topk else None),
                             num_gpus=spec.resources.num_gpus)
        # vllm.sleep: asleep between scorings; frozen, so its host copy is made once (engine/vllm/sleep.py)
        self.sleeper = Sleeper(self.llm, spec.vllm.sleep, keep_weights=True)
        self.stop_ids = eos_ids(self.tokenizer, generation_config(spec.model))
        self._hf: TeacherScorer | None = None
        self.sleeper.sleep()  # asleep from the start: an engine built after this one finds the memory free

    def _teacher_prompt_ids(self, rollouts: Rollouts) -> list[list[int]]:
        if self.spec.system_prompt is None:
            return rollouts.prompt_ids
        return self.render(rollouts.prompts, self.spec.system_prompt)

    def score(self, rollouts: Rollouts) -> torch.Tensor:
        """log π_T(y_t | teacher's view of s_t) for every completion token, [B, T]."""
        with self.sleeper.turn():
            return token_logprobs(self.llm, self._teacher_prompt_ids(rollouts), rollouts.completion_ids_BT,
                                  rollouts.loss_mask_BT)

    def _full(self) -> TeacherScorer:
        """The HF copy, on the CPU: the only copy of the teacher on its GPU is vLLM's."""
        if self._hf is None:
            on_host = self.spec.resources.model_copy(update={"num_gpus": 0.0})  # engine_device: "cpu"
            self._hf = self.full_engine(self.name, self.spec.model_copy(update={"engine": "hf", "resources": on_host}))
        return self._hf

    def prefix_counts(self) -> dict[str, float]:
        """No prefix counts (vLLM prefills every prompt it returns prompt logprobs for: docs/engines.md);
        with vllm.sleep, the step's sleep and wake seconds and the GPU memory free after each
        (engine/vllm/sleep.py; loops/routing.py: prefix_metrics)."""
        return self.sleeper.take_counts()

    def check_scores(self, rollouts: Rollouts) -> dict[str, float] | None:
        """vLLM's scores of the sampled tokens against an HF recomputation of the same tokens, on the
        first `CHECK_ROWS` rows: {"max_abs_diff", "mean_abs_diff"} of log π_T over their tokens, or
        None when those rows hold no token. The drift gate calls it every few steps: a vLLM engine
        whose kernels, dtype or weights went wrong scores differently from transformers, and the
        sampled-token advantages A_t = −c·(log μ − log π_T) would carry the error unnoticed."""
        part = rollouts.select(list(range(min(self.CHECK_ROWS, len(rollouts)))))
        mask_BT = part.loss_mask_BT.bool()
        if not mask_BT.any():
            return None
        diff = (self.score(part) - self._full().score(part)).abs()[mask_BT]
        return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean())}

    def score_full(self, rollouts: Rollouts) -> torch.Tensor:
        return self._full().score_full(rollouts)

    def score_topk(self, rollouts: Rollouts, k: int) -> tuple[torch.Tensor, TeacherTopK]:
        """As TeacherScorer.score_topk, through vLLM's prompt logprobs (the tail from the top-k)."""
        with self.sleeper.turn():
            token_BT, ids_BTK, values_BTK = topk_prompt_logprobs(self.llm, self._teacher_prompt_ids(rollouts),
                                                                 rollouts.completion_ids_BT, rollouts.loss_mask_BT, k)
        return token_BT, TeacherTopK(ids_BTK, values_BTK, tail_from_topk(values_BTK))

    def score_with_full(self, rollouts: Rollouts) -> tuple[torch.Tensor, TeacherFull]:
        return self._full().score_with_full(rollouts)

    def score_with_hidden(self, rollouts: Rollouts) -> tuple[torch.Tensor, TeacherHidden]:
        return self._full().score_with_hidden(rollouts)

    def output_head(self) -> torch.Tensor:
        return self._full().output_head()

    def exact_kl(self, rollouts: Rollouts, student_logprobs_BTV: torch.Tensor, direction: str) -> dict[str, float]:
        return self._full().exact_kl(rollouts, student_logprobs_BTV, direction)

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        """The teacher's own answers; `prompt_ids` are the student's view (see TeacherScorer.sample)."""
        with self.sleeper.turn():
            out = generate(self.llm, self.render(prompts, self.spec.system_prompt), params, self.stop_ids)
        texts = decode_completions(self.tokenizer, out)
        return Rollouts(prompts, self.render(prompts), out.completion_ids_BT, out.loss_mask_BT,
                        out.logprobs_BT, texts)

    def vocab_fingerprint(self) -> tuple[int, str]:
        return vocab_fingerprint(self.tokenizer)
