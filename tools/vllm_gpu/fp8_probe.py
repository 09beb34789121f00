#!/usr/bin/env python3
"""Where an FP8 export served by vLLM on a GPU departs from the QAT model it came from: the
log-probs of one completion under each way of computing it, and their pairwise max |Δ| (nats).

    python3 tools/vllm_gpu/fp8_probe.py        (on the GPU machine, with the vLLM bundle)

The model is tests/vllm/test_vllm_fp8.py's (tiny Llama, init_std 0.2).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.vllm.test_vllm_fp8 import COMPLETION, PROMPT, SPEC  # noqa: E402

from k3post.config.schema import ModelSpec, TeacherSpec, VllmSpec  # noqa: E402
from k3post.model.export.fp8_export import export_fp8  # noqa: E402
from k3post.model.loading.load import load_model  # noqa: E402
from k3post.model.quant.qat import prepare_fp8_qat, set_fake_quant  # noqa: E402
from k3post.model.scoring.logprobs import completion_logprobs  # noqa: E402
from k3post.types import Prompt, Rollouts  # noqa: E402

IDS, MASK = torch.tensor([COMPLETION]), torch.ones(1, len(COMPLETION))


def hf(model, pad_id, device, dtype, fake_quant):
    model = model.to(device, dtype)
    set_fake_quant(model, fake_quant)
    with torch.no_grad():
        return completion_logprobs(model, [PROMPT], IDS, MASK, pad_id, 1.0).float().cpu()


def served(path_or_spec: ModelSpec, dtype: str):
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher  # noqa: PLC0415

    teacher = VLLMTeacher("x", TeacherSpec(model=path_or_spec, engine="vllm", vllm=VllmSpec(
        dtype=dtype, enforce_eager=True, max_model_len=128, kv_cache_gib=0.25, gpu_memory_utilization=0.2)))
    out = teacher.score(Rollouts([Prompt("x", "s", "t", ())], [PROMPT], IDS, MASK, torch.zeros_like(MASK)))
    del teacher
    return out


def main() -> int:
    model, tokenizer = load_model(SPEC)
    prepare_fp8_qat(model)
    export_fp8(model, tokenizer, Path("/tmp/fp8-probe"))
    pad = tokenizer.pad_token_id
    rows = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
        for fq in (True, False):
            rows[f"HF {'QAT' if fq else 'plain'} {device} {str(dtype)[6:]}"] = hf(model, pad, device, dtype, fq)
    rows["vLLM FP8 export bf16"] = served(ModelSpec(path="/tmp/fp8-probe"), "bfloat16")
    rows["vLLM plain bf16"] = served(SPEC, "bfloat16")
    for name, values in rows.items():
        print(f"{name:28s}", " ".join(f"{v:8.3f}" for v in values[0].tolist()))
    print("\npairwise max |Δ| (nats)")
    for (a, x), (b, y) in itertools.combinations(rows.items(), 2):
        print(f"{a:28s} vs {b:28s} {(x - y).abs().max().item():.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
