"""The fast HF rollout engine: `HFSampler` with a static KV cache and, on a GPU, a decode step
compiled with CUDA graphs (model/generation/fast_sampling.py). Chosen by `sampling.cache: static`
(`sampling.compile: true` adds torch.compile); vLLM stays the first choice where it is installed.
With `draft.speculate` it drafts with the student's MTP head and verifies over the same static
caches (model/generation/fast_speculation.py), switching itself off where that does not pay.

Every generation runs on one worker thread that the engine owns, for two reasons:
- CUDA graphs (torch.compile's "reduce-overhead") are recorded and replayed per thread, so the
  thread that compiled a shape must be the one that replays it, whoever calls `sample`;
- on a GPU that thread works on its own CUDA stream, so when the async loop trains on step k
  while this engine samples step k+1 (loops/distill_async.py), the two kernel streams can run
  side by side instead of queueing on the default stream.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import torch

from k3post.config.draft_schema import SpeculateSpec
from k3post.config.schema import ModelSpec
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.samplers.speculative_sampler import Speculation
from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.sampling import Completions, eos_ids
from k3post.types import SamplingParams


class FastHFSampler(HFSampler):
    """HFSampler whose completions come from `StaticSampler` (same Rollouts, same log μ)."""

    def __init__(self, model: ModelSpec, num_threads: int | None = None, device: str = "cpu",
                 compile: bool = False, min_bucket: int = 128, system_prompt: str | None = None,
                 fp8_from_version: int | None = None, speculate: SpeculateSpec | None = None, draft_seed: int = 0,
                 draft_hidden: str = "final_norm", on_policy: str = "off"):
        super().__init__(model, num_threads, device, system_prompt, fp8_from_version, on_policy=on_policy)
        self.engine = StaticSampler(self.model, self.tokenizer.pad_token_id,
                                    eos_ids(self.tokenizer, self.model.generation_config), compile, min_bucket,
                                    bitwise=self.bitwise)
        if speculate is not None:  # speculative rounds over the same static caches (model/generation/fast_speculation.py)
            self.speculation = Speculation(self.model, self.tokenizer, speculate.tokens, speculate.min_accept,
                                           draft_seed, draft_hidden, static=self.engine)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="k3post-sampler")
        on_gpu = self.device.type == "cuda"
        self._stream = self._worker.submit(torch.cuda.Stream, self.device).result() if on_gpu else None

    def _on_worker(self, fn, *args):
        """Run fn on the engine's thread (and CUDA stream); wait for it to finish there."""
        def task():
            with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
                out = fn(*args)
            if self._stream is not None:
                self._stream.synchronize()
            return out
        return self._worker.submit(task).result()

    def _complete(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions:
        if self.speculation is not None:
            return self._on_worker(self.speculation.complete, prompt_ids, params)
        return self._on_worker(self.engine.sample, prompt_ids, params)

    def load_weights(self, weights: dict, version: int) -> int:
        if self._stream is not None:
            # The learner's last writes (its optimizer step) were queued on the caller's stream:
            # let them land before this engine's stream copies the weights.
            torch.cuda.current_stream(self.device).synchronize()
        return self._on_worker(super().load_weights, weights, version)

    def close(self) -> None:
        self._worker.shutdown(wait=True)
