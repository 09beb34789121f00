"""The compiled speculative engine on a GPU (model/generation/fast_speculation.py): the path the CPU tests
reach only with Inductor's CPU backend. On CUDA a round is one CUDA graph that writes each row's
columns of the static caches in place, and the emit runs compiled beside it.

- Greedy, it emits plain greedy decoding's tokens (the compiled static engine's), with drafts both
  accepted and rejected in the same batch: a cache column written at the wrong place, or a rejected
  draft's entry left visible, changes the next argmax.
- Sampled, the log-probabilities it stores are the student's, teacher-forced, to fp32 rounding.

Skipped without CUDA; run on a GPU machine with `python -m pytest tests/gpu`.
"""

from __future__ import annotations

import pytest
import torch

from k3post.model.generation.fast_sampling import StaticSampler
from k3post.model.generation.fast_speculation import StaticSpeculativeDecoder
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.types import SamplingParams
from tests.unit.test_speculative_sampling import EOS, PAD, PROMPTS, copy_head, tiny

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@torch.no_grad()
def test_compiled_rounds_on_a_gpu_are_greedy_decoding_and_store_the_students_logprobs():
    model = tiny(8, 4, std=0.8).cuda()
    head = copy_head(model).cuda()  # often right on this student: accepted and rejected drafts
    sampler = StaticSampler(model, PAD, [EOS], compile=True, min_bucket=4)
    assert sampler.compiled
    greedy_params = SamplingParams(12, 1.0, 1.0, 0)
    plain = sampler.sample(PROMPTS, greedy_params, greedy=True)
    engine = StaticSpeculativeDecoder(sampler, head, 2)
    for _ in range(2):  # the second call runs every round as a graph (the first's first round is eager)
        greedy, stats = engine.sample(PROMPTS, greedy_params, greedy=True)
        assert torch.equal(greedy.completion_ids_BT, plain.completion_ids_BT)
        assert 0 < stats.accepted < stats.drafted
    params = SamplingParams(16, 0.9, 0.95, seed=3)
    for _ in range(2):
        out, stats = engine.sample(PROMPTS, params)
    assert 0 < stats.accepted < stats.drafted
    recomputed = completion_logprobs(model, PROMPTS, out.completion_ids_BT.cuda(), out.loss_mask_BT.cuda(), PAD,
                                     params.temperature)
    assert (recomputed.cpu() - out.logprobs_BT.cpu()).abs().max() < 1e-4


@torch.no_grad()
def test_a_head_synced_after_the_sampler_fused_the_student_drafts_alike_compiled_and_eager():
    """The speculation engine builds its head after the compiled sampler fused the student's q/k/v
    and gate/up, so the head's block is a copy of a fused block; a weight sync into it must reach the
    stacks the compiled round reads. Greedy, the compiled rounds then draft, accept and emit exactly
    what eager rounds over the same weights do (until commit 4d8d136 they drafted with the block as
    first copied, and accepted other counts)."""
    from k3post.model.generation.draft_head import MtpHead  # noqa: PLC0415
    from k3post.model.training.weights import import_weights  # noqa: PLC0415

    model = tiny(8, 4, std=0.8).cuda()
    compiled_sampler = StaticSampler(model, PAD, [EOS], compile=True, min_bucket=4)  # fuses the student
    head = MtpHead(model, 0)  # as engine/samplers/speculative_sampler.py builds it, after the sampler
    torch.manual_seed(1)
    synced = {k: v.cpu() for k, v in copy_head(tiny(8, 4, std=0.8)).state_dict().items()}
    for name in ("o_proj", "down_proj", "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):  # the block counts
        key = next(k for k in synced if k.endswith(f"{name}.weight"))
        synced[key] = synced[key] + 0.3 * torch.randn_like(synced[key])
    import_weights(head, synced)
    params = SamplingParams(12, 1.0, 1.0, 0)
    eager, eager_stats = StaticSpeculativeDecoder(StaticSampler(model, PAD, [EOS], min_bucket=4), head, 2).sample(
        PROMPTS, params, greedy=True)
    engine = StaticSpeculativeDecoder(compiled_sampler, head, 2)
    for _ in range(2):  # the second call runs every round as a graph
        compiled, compiled_stats = engine.sample(PROMPTS, params, greedy=True)
    assert torch.equal(compiled.completion_ids_BT, eager.completion_ids_BT)
    assert compiled_stats == eager_stats and 0 < eager_stats.accepted < eager_stats.drafted
