"""A vLLM teacher with another tokenizer than the student's (engine/teachers/cross_teacher.py around
VLLMTeacher): its scores of the teacher's reading of the student's text equal the HF engine's.
Marked `vllm`: `pytest -m "not vllm"` skips it."""

from __future__ import annotations

import pytest
import torch

from k3post.config.schema import ModelSpec, TeacherSpec, TinyModelSpec, VllmSpec
from k3post.engine.teachers.cross_teacher import CrossTokenizerTeacher
from k3post.engine.samplers.sampler import HFSampler
from k3post.types import Prompt, SamplingParams
from tests.tokenizer_fixtures import byte_level_bpe, tiny_teacher_dir
from tests.vllm.tolerance import FP32_TOL

pytestmark = pytest.mark.vllm

# The CPU attention kernels take head sizes that are multiples of 32: hidden 64 over 2 heads.
STUDENT = ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=5))
ENGINE = VllmSpec(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_gib=0.25)
PROMPTS = [Prompt(f"p{i}", "chat", "t", (("user", text),))
           for i, text in enumerate(["What is 2+2?", "Name a colour.", "Say hi", "Count to three, please."])]


def test_a_vllm_teacher_with_another_tokenizer_scores_as_the_hf_one(tmp_path):
    directory = tiny_teacher_dir(tmp_path / "teacher", byte_level_bpe(), seed=4, hidden=64, init_std=0.2, heads=2)
    spec = TeacherSpec(model=ModelSpec(path=str(directory)), system_prompt="You are terse.")
    hf = CrossTokenizerTeacher("t", spec, STUDENT)
    vllm = CrossTokenizerTeacher("t", spec.model_copy(update={"engine": "vllm", "vllm": ENGINE}), STUDENT)
    rollouts = HFSampler(STUDENT).sample(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, seed=1))
    want_BT, got_BT = hf.score(rollouts), vllm.score(rollouts)
    mask = rollouts.loss_mask_BT.bool()
    assert mask.sum() > 30 and hf.alignment_counts() == vllm.alignment_counts()
    torch.testing.assert_close(got_BT[mask], want_BT[mask], atol=FP32_TOL, rtol=0)
    assert (got_BT[~mask] == 0).all()


def test_a_vllm_teacher_with_another_tokenizer_sends_the_mapped_top_k_of_the_hf_one(tmp_path):
    """The dense loss's payload across tokenizers: vLLM ranks only its top 4·k, HF its whole
    vocabulary; where the HF teacher's k mapped tokens are inside vLLM's top 4·k (asserted to be most
    1:1 positions here) the two send the same ids, logprobs and tail; elsewhere vLLM sends fewer bins,
    or none where its top 4·k hold no mapped token."""
    from k3post.algo.topk import repeated_slots
    from k3post.config.loss_schema import TeacherLossSpec

    directory = tiny_teacher_dir(tmp_path / "teacher", byte_level_bpe(), seed=4, hidden=64, init_std=0.2, heads=2)
    spec = TeacherSpec(model=ModelSpec(path=str(directory)), loss=TeacherLossSpec(kind="topk_reverse", k=4))
    hf = CrossTokenizerTeacher("t", spec, STUDENT)
    vllm = CrossTokenizerTeacher("t", spec.model_copy(update={"engine": "vllm", "vllm": ENGINE}), STUDENT)
    rollouts = HFSampler(STUDENT).sample(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, seed=1))
    (tau_hf, want), (tau_vllm, got) = hf.score_topk(rollouts, 4), vllm.score_topk(rollouts, 4)
    torch.testing.assert_close(tau_vllm, tau_hf, atol=FP32_TOL, rtol=0)
    got_signal, want_signal = got.signal_BT.bool(), want.signal_BT.bool()
    assert want_signal.sum() > 10 and not (got_signal & ~want_signal).any()
    assert got_signal.sum() >= 0.9 * want_signal.sum()  # a position whose top 16 hold no mapped token: none
    full = ~repeated_slots(got.ids_BTK.long()).any(-1) & got_signal
    assert full.sum() >= 0.5 * want.signal_BT.sum()
    # The same ids where HF's adjacent ranks are farther apart than twice the tolerance (a near tie
    # may swap two ids under the GPU's TF32 attention; on the CPU that is nearly every position).
    ranked = want.logprobs_BTK[full]
    apart = (ranked[:, :-1] - ranked[:, 1:]).abs().nan_to_num(0.0).amin(dim=-1) > 2 * FP32_TOL
    assert apart.float().mean() > 0.5
    assert torch.equal(got.ids_BTK[full][apart], want.ids_BTK[full][apart])
    torch.testing.assert_close(got.logprobs_BTK[full], want.logprobs_BTK[full], atol=FP32_TOL, rtol=0)
    torch.testing.assert_close(got.tail_logprobs_BT[full].exp(), want.tail_logprobs_BT[full].exp(), atol=FP32_TOL, rtol=0)
