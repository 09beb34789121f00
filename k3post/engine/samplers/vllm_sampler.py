"""The student's rollout engine on vLLM, behind the same interface as `HFSampler`.

Full next-token distributions (the exact-KL evaluations) are not something vLLM returns (it
gives top-k per position), so `full_logprobs` computes them with an HF copy of the student on the
CPU, built when an evaluation first asks at a weight version and dropped at the next sync. Nothing
is copied at a sync: the sampler keeps a *reference* to the weights it was last handed (what the
transport already put in this process: arrays in Ray's object store, tensors received over a
broadcast group, the learner's memory mapped under CUDA IPC, or, for an engine core in a process
of its own, the learner's CUDA IPC handles, mapped here only if the copy is built) until the HF
copy is built from them or the next weights come. (Before: every sync copied every weight GPU →
host for an HF copy kept in step for the whole run.)
"""

from __future__ import annotations

from typing import Any

import torch

from k3post.config.schema import ModelSpec, VllmSpec
from k3post.engine.common import set_threads
from k3post.engine.samplers.sampler import HFSampler, vocab_fingerprint
from k3post.engine.transport.weight_broadcast import BroadcastReceiver, IpcHandles, open_ipc_handles
from k3post.engine.transport.weight_check import Checksum, checked_names
from k3post.engine.vllm.sleep import Sleeper
from k3post.engine.vllm.vllm_engine import build_llm, generate, received_checksums, timed_sync, token_logprobs
from k3post.model.generation.sampling import decode_completions, eos_ids
from k3post.model.loading.load import generation_config, load_tokenizer
from k3post.model.scoring.chat_render import ChatRenderer
from k3post.model.training.weights import import_weights
from k3post.types import Prompt, Rollouts, SamplingParams


class VLLMSampler(BroadcastReceiver):
    """Generates completions of the current student weights with vLLM and records log μ."""

    def __init__(self, model: ModelSpec, vllm: VllmSpec, num_threads: int | None = None, seed: int = 0,
                 system_prompt: str | None = None, num_gpus: float = 0.0):
        set_threads(num_threads)
        self.system_prompt = system_prompt  # sampling.system_prompt: None leaves it to the chat template
        self.spec, self.vllm_spec = model, vllm
        self.tokenizer = load_tokenizer(model)
        self.render = ChatRenderer(self.tokenizer)
        self.llm = build_llm(model, vllm, seed, num_gpus=num_gpus)  # num_gpus: resources.samplers
        self.sleeper = Sleeper(self.llm, vllm.sleep)  # vllm.sleep: asleep between rollouts (engine/vllm/sleep.py)
        self.stop_ids = eos_ids(self.tokenizer, generation_config(model))
        self.weight_version = 0
        self.last_sync_s = 0.0
        # The weights last handed to load_weights, by reference (None: the model's own, version 0,
        # or already in the HF copy), and the HF copy of this weight version, once an evaluation asked.
        self._weights: dict[str, Any] | None = None
        self._hf: HFSampler | None = None
        self.sleeper.sleep()  # asleep from the start: an engine built after this one finds the memory free

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts:
        prompt_ids = self.render(prompts, self.system_prompt)
        with self.sleeper.turn():
            out = generate(self.llm, prompt_ids, params, self.stop_ids)
        texts = decode_completions(self.tokenizer, out)
        # The last sync's seconds inside the engine (transport and reload), beside its wake in the
        # sleep counts: what the loop's time/sync_s spends outside them is the weight check.
        stats = {**self.sleep_counts(), "sampler/reload_s": self.last_sync_s}
        self.last_sync_s = 0.0
        return Rollouts(prompts, prompt_ids, out.completion_ids_BT, out.loss_mask_BT, out.logprobs_BT, texts,
                        self.weight_version, sampler_stats=stats)

    def load_weights(self, weights: dict, version: int) -> int:
        """Replace every weight (transport: `vllm.weight_sync`), stamp the version. `weights` is
        kept by reference for `full_logprobs`; nothing is copied."""
        check = tuple(checked_names(list(weights), version))  # the weight-sync check's tensors, at arrival
        self.sleeper.wake(("weights",))  # asleep: the weights' memory mapped again; the next rollout wakes the KV cache
        self.last_sync_s = timed_sync(self.llm, weights, self.vllm_spec.weight_sync, check)
        self._weights, self._hf = weights, None
        self.weight_version = version
        return version

    def load_ipc_weights(self, handles: dict[str, tuple], version: int) -> int:
        """As BroadcastReceiver's, except that an engine core in a process of its own (`vllm.sleep`)
        taking the in-place sync maps the learner's handles itself: this actor never maps them,
        since a tensor it had mapped could not be shared with the core again (torch refuses)."""
        if not getattr(self.llm, "k3post_own_process", False) or self.vllm_spec.weight_sync != "in_place":
            return super().load_ipc_weights(handles, version)  # the checkpoint transport writes tensors
        return self.load_weights(IpcHandles(handles), version)

    def weight_checksums(self, names: list[str]) -> dict[str, Checksum]:
        """Checksums of the named tensors as the last sync's reload received them (vllm_engine.py:
        received_checksums); a name the reload did not checksum is absent, which the check reports."""
        received = received_checksums(self.llm)
        return {name: received[name] for name in names if name in received}

    def receive_weights(self, version: int) -> int:
        """As BroadcastReceiver's; the last weights are let go first, so that a sampler on a GPU
        never holds two received copies while the next arrives."""
        self._weights, self._hf = None, None
        return super().receive_weights(version)

    def sequence_logprobs(self, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor,
                          loss_mask_BT: torch.Tensor) -> torch.Tensor:
        """log π_θ of given completion tokens as this engine computes them (parity checks)."""
        with self.sleeper.turn():
            return token_logprobs(self.llm, prompt_ids, completion_ids_BT, loss_mask_BT)

    def sleep_counts(self) -> dict[str, float]:
        """Sleep and wake seconds and counts since the last call, and the GPU memory free after each
        (engine/vllm/sleep.py), as `sampler/<figure>`; {} without vllm.sleep. Each rollout carries
        them (`Rollouts.sampler_stats`: the step's metrics): the last sync's wake, its own, its sleep."""
        return {f"sampler/{key}": value for key, value in self.sleeper.take_counts().items()}

    def full_logprobs(self, rollouts: Rollouts, temperature: float = 1.0) -> torch.Tensor:
        """log π_θ(· | s_t) over the whole vocabulary, [B, T, V], from the HF copy of the current
        weights (on the CPU; built on the first call at this weight version, from the weights last
        handed over, or the model's own before the first sync; dropped at the next sync).

        Evaluation calls it between a sync and the learner's next step (loops/evaluate.py; the
        async loop syncs first), so weights the sampler only borrows (the learner's live tensors
        in process, or mapped under CUDA IPC) still hold this version when the copy is built."""
        if self._hf is None:
            self._hf = HFSampler(self.spec)  # device "cpu": never beside vLLM on its GPU
            if self._weights is not None:  # the learner's handles mapped here only now, to be read
                weights = open_ipc_handles(self._weights) if isinstance(self._weights, IpcHandles) else self._weights
                import_weights(self._hf.model, weights)
                self._weights = None  # in the copy now: let the transport's buffers go
        return self._hf.full_logprobs(rollouts, temperature)

    def vocab_fingerprint(self) -> tuple[int, str]:
        return vocab_fingerprint(self.tokenizer)

