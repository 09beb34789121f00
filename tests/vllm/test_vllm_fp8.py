"""An FP8 export (compressed-tensors, per-channel FP8 weights, dynamic per-token FP8
activations) served by vLLM computes the fake-quant QAT model's logprobs."""

from __future__ import annotations

import json

import pytest
import torch

from k3post.config.schema import ModelSpec, TeacherSpec, TinyModelSpec, VllmSpec
from k3post.model.export.fp8_export import export_fp8
from k3post.model.loading.load import load_model
from k3post.model.scoring.logprobs import completion_logprobs
from k3post.model.quant.qat import prepare_fp8_qat, set_fake_quant

pytestmark = pytest.mark.vllm

SPEC = ModelSpec(tiny=TinyModelSpec(hidden_size=64, num_heads=2, num_kv_heads=1, seed=5, init_std=0.2))
PROMPT, COMPLETION = [1, 5, 9, 20, 33], [41, 17, 12, 60, 61, 62, 3, 8]


# On a GPU the export runs on Hopper's FP8 GEMMs (CUTLASS), which write bf16 or fp16: the engine is
# bf16 there, and so is the QAT model it is compared with (on the GPU, where its forward is a real
# FP8 GEMM too: model/quant/fp8_linear.py). Measured on an H100 (2026-12-07): see the record below.
CUDA = torch.cuda.is_available()
DTYPE, DEVICE = ("bfloat16", "cuda") if CUDA else ("float32", "cpu")
TOL = 5e-2 if CUDA else 1e-3


def qat_and_plain_logprobs(model, tokenizer, ids_BT, mask_BT):
    """The QAT model's log-probs of the completion with fake quantisation on, then off."""
    model = model.to(DEVICE, getattr(torch, DTYPE))
    with torch.no_grad():
        qat_BT = completion_logprobs(model, [PROMPT], ids_BT, mask_BT, tokenizer.pad_token_id, 1.0).float().cpu()
        set_fake_quant(model, False)
        plain_BT = completion_logprobs(model, [PROMPT], ids_BT, mask_BT, tokenizer.pad_token_id, 1.0).float().cpu()
    return qat_BT, plain_BT


def test_vllm_serves_the_fp8_export_with_the_fake_quant_models_logprobs(tmp_path, record_property):
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher
    from k3post.types import Prompt, Rollouts

    model, tokenizer = load_model(SPEC)
    prepare_fp8_qat(model)
    export_fp8(model, tokenizer, tmp_path / "fp8")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["format"] == \
        "float-quantized"
    ids_BT, mask_BT = torch.tensor([COMPLETION]), torch.ones(1, len(COMPLETION))
    qat_BT, plain_BT = qat_and_plain_logprobs(model, tokenizer, ids_BT, mask_BT)

    served = VLLMTeacher("fp8", TeacherSpec(model=ModelSpec(path=str(tmp_path / "fp8")), engine="vllm",
                                            vllm=VllmSpec(dtype=DTYPE, enforce_eager=True, max_model_len=128,
                                                          kv_cache_gib=0.25)))
    rollouts = Rollouts([Prompt("x", "s", "t", ())], [PROMPT], ids_BT, mask_BT, torch.zeros_like(mask_BT))
    fp8_BT = served.score(rollouts)
    served_vs_qat, quantisation = (fp8_BT - qat_BT).abs().max().item(), (plain_BT - qat_BT).abs().max().item()
    record_property("served_minus_qat_max", served_vs_qat)
    record_property("plain_minus_qat_max", quantisation)
    print(f"FP8 export on {DEVICE} ({DTYPE}): |served - QAT| max {served_vs_qat:.2e}, |plain - QAT| max {quantisation:.2e}")
    # vLLM runs the FP8 layers as the fake-quant model emulates them...
    assert served_vs_qat < TOL
    # ...which is measurably not the full-precision model: the quantization is really applied.
    assert quantisation > max(1e-3, 2 * served_vs_qat)
