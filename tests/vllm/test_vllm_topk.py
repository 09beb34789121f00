"""vLLM top-k teacher scores against the HF engine's on the real SmolLM2-135M-Instruct.

The top-k losses (algo/topk.py) take the teacher's k most likely ids and their logprobs at every
completion position; a teacher on vLLM gets them from `prompt_logprobs=k`, one on HF from its full
distribution. Both must send the same thing: at every position the same ids (ties aside: ids whose
HF logprobs are within the tolerance may come in either order) and logprobs within 1e-3, and the
same tail mass. Marked `vllm` (starts an engine: minutes on a CPU).
"""

from __future__ import annotations

import pytest
import torch

from k3post.config.loss_schema import TeacherLossSpec
from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.types import Prompt, SamplingParams
from tests.vllm.tolerance import FP32_TOL

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # a real SmolLM2 on vLLM and HF: ~4 min; K3POST_SLOW=1

SMOL = ModelSpec(builtin="smollm2-135m-instruct")
K = 8
TEACHER = TeacherSpec(model=SMOL, engine="vllm", loss=TeacherLossSpec(kind="topk_reverse", k=K),
                      vllm=VllmSpec(dtype="float32", enforce_eager=True, max_model_len=512, kv_cache_gib=0.5))
# The student: SmolLM2 with most of its layers pruned (its tokens are not the teacher's favourites).
STUDENT = ModelSpec(builtin="smollm2-135m-instruct", keep_layers=list(range(12)) + [29])
PROMPTS = [Prompt(f"p{i}", "chat", "chat", (("user", q),))
           for i, q in enumerate(["What is 7 + 5?", "Name a fruit that is yellow.", "Say hello in French."])]
TOL = FP32_TOL


def test_vllm_top_k_equals_hf_top_k_on_smollm2():
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher

    rollouts = HFSampler(STUDENT).sample(PROMPTS, SamplingParams(max_new_tokens=16, temperature=1.0, seed=0))
    hf = TeacherScorer("chat", TEACHER.model_copy(update={"engine": "hf"}))
    hf_token_BT, want = hf.score_topk(rollouts, K)
    full_BTV = hf.score_full(rollouts)
    got_token_BT, got = VLLMTeacher("chat", TEACHER).score_topk(rollouts, K)
    mask = rollouts.loss_mask_BT.bool()
    assert mask.sum() > 30
    torch.testing.assert_close(got_token_BT[mask], hf_token_BT[mask], atol=TOL, rtol=0)
    # Logprobs rank by rank (sorted either way, so ties do not matter).
    torch.testing.assert_close(got.logprobs_BTK[mask], want.logprobs_BTK[mask], atol=TOL, rtol=0)
    # Ids: each id vLLM sends at rank r has, under HF, the logprob HF has at rank r (a tied id is fine)...
    hf_of_vllm_ids = full_BTV.gather(-1, got.ids_BTK.long())
    torch.testing.assert_close(hf_of_vllm_ids[mask], want.logprobs_BTK[mask], atol=TOL, rtol=0)
    # ... and where HF's ranks are clearly apart, it is HF's id itself.
    values = full_BTV.topk(K + 1, dim=-1).values[mask]  # one more: a tie at rank k may swap an id out
    steps = values[:, :-1] - values[:, 1:]
    before = torch.cat([torch.full_like(steps[:, :1], float("inf")), steps[:, :K - 1]], dim=1)
    gaps = torch.minimum(before, steps[:, :K])
    clear = gaps > 2 * TOL  # farther apart than twice the largest error: no swap
    assert clear.float().mean() > 0.8
    assert torch.equal(got.ids_BTK[mask][clear], want.ids_BTK[mask][clear])
    # The tail mass (vLLM: 1 − Σ top-k; HF: its exact complement).
    torch.testing.assert_close(got.tail_logprobs_BT[mask].exp(), want.tail_logprobs_BT[mask].exp(), atol=TOL, rtol=0)
