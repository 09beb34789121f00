"""`sampling.on_policy: bitwise` on a CUDA GPU, in bf16: the sampler's recorded log μ and the learner's
recomputed log π are equal bit for bit (model/batch_invariant.py's GPU path: row-wise pieces in
fixed blocks of rows, the Triton attention of model/invariant_attention.py).

- a decode step equals the whole-sequence forward at every position, also beside a longer,
  left-padded row (this tiny model's plain bf16 forward happened to agree there too on an H100,
  so the negative control is the sampler-and-learner one below);
- the learner's log π of sampled rollouts equals log μ in any micro-batching (batches 1, 3, 8);
  without the mode the two differ;
- the static-cache sampler in the mode, its decode step eager or replayed from a CUDA graph:
  the learner recomputes its log μ, and greedy replays equal the eager run bit for bit;
- 20 OPD steps of a run (`k3post run --in-process`, batch 32, 32 new tokens, the sampler and the
  learner on the GPU): the drift gate stops a bitwise run at the first step whose largest gap is
  not exactly 0, so the run finishing is the proof; every step's importance ratio is exactly 1.

Skipped without CUDA. The tiny models have head size 64 (hidden 256, 4 heads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.model.loading.load import load_model
from tests.unit.test_batch_invariant import PROMPTS, assert_decode_equals_whole, recomputed, sample

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model(ModelSpec(tiny=TinyModelSpec(hidden_size=256, num_layers=2, seed=1, init_std=0.1)))
    return model.to("cuda", torch.bfloat16).eval(), tokenizer


def test_a_decode_step_equals_the_whole_sequence_forward_on_the_gpu(tiny):
    """A decode step equals the whole-sequence forward at every position, alone and beside a longer
    left-padded row (the unit test's check, on the GPU path)."""
    assert_decode_equals_whole(tiny[0])


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_the_learner_recomputes_the_samplers_logprobs_bit_for_bit_on_the_gpu(tiny, batch):
    model, tokenizer = tiny
    prompts = PROMPTS[-batch:] if batch < 8 else PROMPTS
    out = sample(model, tokenizer, prompts, 1.0, bitwise=True)
    assert out.loss_mask_BT.sum() >= 2 * batch
    for micro_batch in sorted({1, 2, batch}):
        assert torch.equal(recomputed(model, tokenizer, prompts, out, micro_batch, 1.0), out.logprobs_BT)


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "cuda-graph"])
def test_the_static_cache_sampler_in_the_mode_eager_and_replayed_from_a_cuda_graph(tiny, compile, record_property):
    """The static-cache sampler in the mode on the GPU, its decode step eager or recorded once as a
    CUDA graph and replayed (model/generation/graphed_step.py): the learner recomputes its log μ
    bit for bit, and a greedy run replayed from the graph draws the eager run's tokens with the
    eager run's log μ, to the bit (no random stream to tell them apart)."""
    import time

    from k3post.model.generation.fast_sampling import StaticSampler
    from k3post.model.generation.sampling import eos_ids
    from k3post.types import SamplingParams

    model, tokenizer = tiny
    stops = eos_ids(tokenizer, model.generation_config)
    engine = StaticSampler(model, tokenizer.pad_token_id, stops, compile=compile, bitwise=True)
    assert engine.graphs == compile and not engine.compiled
    params = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=1.0, seed=0)
    out = engine.sample(PROMPTS, params)
    for micro_batch in (1, 3, 8):
        assert torch.equal(recomputed(model, tokenizer, PROMPTS, out, micro_batch, 0.7), out.logprobs_BT)
    eager = StaticSampler(model, tokenizer.pad_token_id, stops, bitwise=True)
    want = eager.sample(PROMPTS, params, greedy=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    got = engine.sample(PROMPTS, params, greedy=True)
    torch.cuda.synchronize()
    record_property("greedy_16_tokens_s", time.perf_counter() - started)
    assert torch.equal(got.completion_ids_BT, want.completion_ids_BT) and torch.equal(got.logprobs_BT, want.logprobs_BT)


def test_without_the_mode_the_two_differ_on_the_gpu(tiny, record_property):
    model, tokenizer = tiny
    out = sample(model, tokenizer, PROMPTS, 1.0, bitwise=False)
    gap = (recomputed(model, tokenizer, PROMPTS, out, 3, 1.0, bitwise=False) - out.logprobs_BT).abs()
    record_property("mode_off_max_gap", gap.max().item())
    assert gap.max().item() > 0


@pytest.mark.parametrize("qat", [[], ["qat.enabled=true", "sampling.weights=fp8"]], ids=["bf16", "fp8-qat"])
def test_twenty_opd_steps_with_every_ratio_exactly_one(tmp_path, record_property, qat):
    """bf16, and FP8 QAT with rollouts on its grid (the sampler's Fp8Linears and the learner's
    fake-quantised Linears both computed from dequantised operands in the mode)."""
    from k3post.cli.run import run_recipe
    from k3post.track.metrics import read_metrics

    overrides = [*qat, "sampling.on_policy=bitwise", "student.tiny.hidden_size=256", "student.tiny.num_layers=4",
                 "student.dtype=bfloat16", "resources.samplers.num_gpus=0.5", "resources.learner.num_gpus=0.5",
                 "data.prompts_per_step=32", "sampling.max_new_tokens=32", "optim.micro_batch_size=8",
                 "train.steps=20", "train.eval_every=20", "train.checkpoint_every=20"]
    assert run_recipe(REPO / "recipes" / "smoke" / "tiny.yaml", overrides, tmp_path / "run", True, False) == 0
    steps = [m for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "train/logprob_abs_diff_max" in m]
    record_property("steps", len(steps))
    assert len(steps) == 20
    assert all(m["train/logprob_abs_diff_max"] == 0.0 and m["train/ratio_max"] == 1.0 for m in steps)
    assert all(m["train/ratio_mean"] == 1.0 for m in steps)
