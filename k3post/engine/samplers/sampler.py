"""The student's rollout engine on Hugging Face transformers (the CPU default and the
reference the faster engines are tested against)."""

from __future__ import annotations

import torch

from k3post.config.draft_schema import SpeculateSpec
from k3post.config.schema import ModelSpec
from k3post.engine.common import check_on_policy, set_threads
from k3post.engine.samplers.speculative_sampler import Speculation
from k3post.engine.transport.weight_broadcast import BroadcastReceiver
from k3post.engine.transport.weight_check import Checksum, checksums_of
from k3post.model.scoring.chat_render import ChatRenderer
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_full_logprobs
from k3post.model.quant.qat import prepare_fp8_qat, set_fake_quant
from k3post.model.training.weights import import_weights, unique_state
from k3post.model.generation.sampling import Completions, decode_completions, sample_completions
from k3post.types import Prompt, Rollouts, SamplingParams


class HFSampler(BroadcastReceiver):
    """Generates completions of the current student weights and records log μ of each token."""

    def __init__(self, model: ModelSpec, num_threads: int | None = None, device: str = "cpu",
                 system_prompt: str | None = None, fp8_from_version: int | None = None,
                 speculate: SpeculateSpec | None = None, draft_seed: int = 0, draft_hidden: str = "final_norm",
                 on_policy: str = "off"):
        """`fp8_from_version` (sampling.weights: fp8): sample with the FP8 QAT forward, as the
        learner computes it, from the weight version at which its fake quantisation turns on
        (qat.fake_quant_after_n_steps: weights pushed after step N drew step N + 1's samples);
        from then on the learner sends the quantised Linears as e4m3 bytes + per-row scales,
        which its `Fp8Linear`s hold and multiply by (model/quant/fp8_linear.py).
        `speculate` (draft.speculate): draft with the student's MTP head and verify
        (engine/samplers/speculative_sampler.py); `draft_seed`: the learner's seed (its initial head);
        `draft_hidden` (draft.hidden): which hidden state of the student the head reads.
        `on_policy` (sampling.on_policy): bitwise samples in the batch-invariant mode and records log μ
        as the learner recomputes log π, bit for bit (model/batch_invariant.py)."""
        set_threads(num_threads)
        self.system_prompt = system_prompt  # sampling.system_prompt: None leaves it to the chat template
        self.model, self.tokenizer = load_model(model)
        check_on_policy(self.model, on_policy)
        self.bitwise = on_policy == "bitwise"
        self.render = ChatRenderer(self.tokenizer)
        self.device = torch.device(device)
        self.model.to(self.device)
        self.fp8_from_version = fp8_from_version
        if fp8_from_version is not None:
            prepare_fp8_qat(self.model)  # the same layers and quantisers as the learner's (model/quant/qat.py)
            from k3post.model.quant.fp8_linear import use_fp8_linears  # noqa: PLC0415 (torchao: only when asked)

            use_fp8_linears(self.model)  # ... able to hold the FP8 weights the sync sends
        self.weight_version = 0
        self._follow_fake_quant()
        self.speculation = (Speculation(self.model, self.tokenizer, speculate.tokens, speculate.min_accept, draft_seed,
                                        draft_hidden) if speculate is not None else None)

    def _follow_fake_quant(self) -> None:
        """FP8 rollouts: the fake quantisation on exactly when the learner's is, for these weights."""
        if self.fp8_from_version is not None:
            set_fake_quant(self.model, self.weight_version >= self.fp8_from_version)

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        prompt_ids = self.render(prompts, self.system_prompt)
        out = self._complete(prompt_ids, params)
        texts = decode_completions(self.tokenizer, out)
        stats = dict(self.speculation.last) if self.speculation is not None else {}
        return Rollouts(prompts, prompt_ids, out.completion_ids_BT, out.loss_mask_BT, out.logprobs_BT, texts,
                        self.weight_version, stats)

    def _complete(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions:
        """The completions of rendered prompts (host tensors); engine/samplers/fast_sampler.py overrides it."""
        if self.speculation is not None:
            return self.speculation.complete(prompt_ids, params)
        return sample_completions(self.model, self.tokenizer, prompt_ids, params, bitwise=self.bitwise)

    def load_weights(self, weights: dict, version: int) -> int:
        """Replace every weight in place (a missing or unexpected name is an error); a speculating
        sampler takes its draft head's out first. Under FP8 rollouts each quantised Linear first
        takes the form the weights carry it in (full, or e4m3 bytes + scales)."""
        if self.speculation is not None:
            weights = self.speculation.load_weights(weights)
        if self.fp8_from_version is not None:
            from k3post.model.quant.fp8_linear import hold_payload_forms  # noqa: PLC0415

            hold_payload_forms(self.model, weights)
        import_weights(self.model, weights)
        self.weight_version = version
        self._follow_fake_quant()
        return version

    def weight_checksums(self, names: list[str]) -> dict[str, Checksum]:
        """Checksums of the named tensors this engine holds now (engine/transport/weight_check.py: the
        learner checksums the same names of what it sent)."""
        state = unique_state(self.model)
        if self.speculation is not None:  # the draft head's tensors travel with the student's
            state |= {"mtp." + k: v for k, v in unique_state(self.speculation.head).items()}
        return checksums_of(state, names)

    @torch.no_grad()
    def full_logprobs(self, rollouts: Rollouts, temperature: float = 1.0) -> torch.Tensor:
        """log π_θ(· | s_t) over the whole vocabulary at every completion position, [B, T, V]."""
        return completion_full_logprobs(self.model, rollouts.prompt_ids, rollouts.completion_ids_BT,
                                        rollouts.loss_mask_BT, self.tokenizer.pad_token_id, temperature)

    def vocab_fingerprint(self) -> tuple[int, str]:
        return vocab_fingerprint(self.tokenizer)


def vocab_fingerprint(tokenizer) -> tuple[int, str]:
    """(vocabulary size, chat template): teachers must match the student on both."""
    return len(tokenizer), tokenizer.chat_template or ""
