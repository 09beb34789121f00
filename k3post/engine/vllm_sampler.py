"""The student's rollout engine on vLLM, behind the same interface as `HFSampler`.

Full next-token distributions (the exact-KL evaluations) are not something vLLM returns (it
gives top-k per position), so they come from an HF copy of the student made on first use and
kept in step with every weight sync.
"""

from __future__ import annotations

from typing import Any

import torch

from k3post.config.schema import ModelSpec, VllmSpec
from k3post.engine.common import set_threads
from k3post.engine.sampler import HFSampler, vocab_fingerprint
from k3post.engine.vllm_engine import build_llm, generate, timed_sync, token_logprobs
from k3post.engine.weight_broadcast import BroadcastReceiver
from k3post.model.load import generation_config, load_tokenizer
from k3post.model.sampling import decode_completions, eos_ids, render_prompts
from k3post.model.weights import import_weights
from k3post.types import Prompt, Rollouts, SamplingParams


class VLLMSampler(BroadcastReceiver):
    """Generates completions of the current student weights with vLLM and records log μ."""

    def __init__(self, model: ModelSpec, vllm: VllmSpec, num_threads: int | None = None, seed: int = 0,
                 system_prompt: str | None = None):
        set_threads(num_threads)
        self.system_prompt = system_prompt  # sampling.system_prompt: None leaves it to the chat template
        self.spec, self.vllm_spec = model, vllm
        self.tokenizer = load_tokenizer(model)
        self.llm = build_llm(model, vllm, seed)
        self.stop_ids = eos_ids(self.tokenizer, generation_config(model))
        self.weight_version = 0
        self.last_sync_s = 0.0
        self._weights: dict[str, Any] | None = None
        self._hf: HFSampler | None = None

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        prompt_ids = render_prompts(self.tokenizer, prompts, self.system_prompt)
        out = generate(self.llm, prompt_ids, params, self.stop_ids)
        texts = decode_completions(self.tokenizer, out)
        return Rollouts(prompts, prompt_ids, out.completion_ids_BT, out.loss_mask_BT, out.logprobs_BT, texts,
                        self.weight_version)

    def load_weights(self, weights: dict, version: int) -> int:
        """Replace every weight (transport: `vllm.weight_sync`), stamp the version."""
        self.last_sync_s = timed_sync(self.llm, weights, self.vllm_spec.weight_sync)
        if self._hf is not None:
            import_weights(self._hf.model, weights)
        else:
            # Kept for the HF copy, made on first use: as host arrays, since GPU tensors may be
            # borrowed (weight_transport: cuda_ipc maps the learner's live parameters, which its
            # next step overwrites) and would otherwise hold a second copy in device memory.
            self._weights = {name: v.detach().cpu() if isinstance(v, torch.Tensor) and v.is_cuda else v
                             for name, v in weights.items()}
        self.weight_version = version
        return version

    def sequence_logprobs(self, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                          loss_mask_BT: torch.Tensor) -> torch.Tensor:
        """log π_θ of given completion tokens as this engine computes them (parity checks)."""
        return token_logprobs(self.llm, prompt_ids, completion_ids_BT, loss_mask_BT)

    def full_logprobs(self, rollouts: Rollouts, temperature: float = 1.0) -> torch.Tensor:
        """log π_θ(· | s_t) over the whole vocabulary, [B, T, V], from the HF copy."""
        if self._hf is None:
            self._hf = HFSampler(self.spec)
            if self._weights is not None:
                import_weights(self._hf.model, self._weights)
                self._weights = None  # the HF copy is kept in step from now on
        return self._hf.full_logprobs(rollouts, temperature)

    def vocab_fingerprint(self) -> tuple[int, str]:
        return vocab_fingerprint(self.tokenizer)

