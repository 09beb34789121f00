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


# On a GPU the export runs on Hopper's FP8 GEMMs (CUTLASS), which write bf16 or fp16, so the engine is
# bf16 there; its reference stays the fp32 fake-quant model the learner trains. The same model
# unquantised, vLLM bf16 on an H100 against HF fp32, differs by up to 0.12 nats (2026-12-07,
# tools/vllm_gpu/fp8_probe.py): the bf16 tolerance is 0.15.
CUDA = torch.cuda.is_available()
DTYPE = "bfloat16" if CUDA else "float32"
TOL = 0.15 if CUDA else 1e-3
# Measured on that H100 (vLLM 0.26.0, tools/vllm_gpu/fp8_probe.py): the served export differs from
# the fp32 QAT model by 0.81 nats and from the unquantised model by 0.62, while k3post's own bf16
# QAT forward on the GPU's FP8 GEMM differs from it by 0.25: on Hopper, vLLM's FP8 path does not
# compute what the QAT emulation does on this model. Strict: the test says so once it does.
GPU_FP8_GAP = pytest.mark.xfail(CUDA, strict=True, reason="vLLM's FP8 GEMMs on an H100 depart from the QAT model "
                                "by 0.81 nats on this model (docs/engines.md, 'What has run on a GPU')")


@GPU_FP8_GAP
def test_vllm_serves_the_fp8_export_with_the_fake_quant_models_logprobs(tmp_path, record_property):
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher
    from k3post.types import Prompt, Rollouts

    model, tokenizer = load_model(SPEC)
    prepare_fp8_qat(model)
    export_fp8(model, tokenizer, tmp_path / "fp8")
    assert json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]["format"] == \
        "float-quantized"
    ids_BT, mask_BT = torch.tensor([COMPLETION]), torch.ones(1, len(COMPLETION))
    with torch.no_grad():
        qat_BT = completion_logprobs(model, [PROMPT], ids_BT, mask_BT, tokenizer.pad_token_id, 1.0)
        set_fake_quant(model, False)
        plain_BT = completion_logprobs(model, [PROMPT], ids_BT, mask_BT, tokenizer.pad_token_id, 1.0)

    served = VLLMTeacher("fp8", TeacherSpec(model=ModelSpec(path=str(tmp_path / "fp8")), engine="vllm",
                                            vllm=VllmSpec(dtype=DTYPE, enforce_eager=True, max_model_len=128,
                                                          kv_cache_gib=0.25)))
    rollouts = Rollouts([Prompt("x", "s", "t", ())], [PROMPT], ids_BT, mask_BT, torch.zeros_like(mask_BT))
    fp8_BT = served.score(rollouts)
    served_vs_qat, quantisation = (fp8_BT - qat_BT).abs().max().item(), (plain_BT - qat_BT).abs().max().item()
    record_property("served_minus_qat_max", served_vs_qat)
    record_property("plain_minus_qat_max", quantisation)
    # vLLM runs the FP8 layers as the fake-quant model emulates them...
    assert served_vs_qat < TOL
    # ...which is measurably not the full-precision model: the quantization is really applied.
    assert quantisation > max(1e-3, 2 * served_vs_qat)
