"""`k3post eval` on the vLLM engine: the same report as on HF where the numbers are
deterministic (NLL of reference replies), and every task kind runs."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

pytestmark = pytest.mark.vllm

TINY = {"hidden_size": 64, "num_heads": 2, "num_kv_heads": 1, "num_layers": 2}


def _recipe(tmp_path, engine: str):
    recipe = {
        "kind": "eval", "engine": engine,
        "vllm": {"dtype": "float32", "enforce_eager": True, "max_model_len": 256, "kv_cache_gib": 0.25},
        "students": {"s": {"model": {"tiny": {**TINY, "seed": 1}}}},
        "teachers": {"t": {"model": {"tiny": {**TINY, "seed": 2, "init_std": 0.2}}}},
        "tasks": [{"name": "arith", "kind": "generation", "data": "builtin:arith", "verifier": "math", "limit": 4,
                   "samples": 2, "k": [1, 2]},
                  {"name": "kl", "kind": "kl", "prompts": "builtin:heldout-chat", "limit": 4},
                  {"name": "nll", "kind": "nll", "data": "builtin:reference", "limit": 6}],
        "sampling": {"max_new_tokens": 8, "batch_size": 8},
    }
    path = tmp_path / f"eval-{engine}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_vllm_eval_matches_hf_on_nll_and_runs_every_task(tmp_path):
    from k3post.cli.main import main

    reports = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / engine
        assert main(["eval", str(_recipe(tmp_path, engine)), "--out", str(out)]) == 0
        reports[engine] = json.loads((out / "report.json").read_text())
    assert reports["vllm"]["engine"] == "vllm"

    def values(report, task):
        return {(r["model"], r["metric"], r.get("teacher")): r["value"] for r in report["records"] if r["task"] == task}

    hf_nll, vllm_nll = values(reports["hf"], "nll"), values(reports["vllm"], "nll")
    assert set(hf_nll) == set(vllm_nll) and {m for m, _, _ in hf_nll} == {"s", "t"}
    for key, value in hf_nll.items():
        # On a GPU also relative: a perplexity of ~200 moves by ~0.1 under vLLM's TF32 attention
        # (4.9e-4 of it on an H100, 2026-12-07; tests/vllm/tolerance.py says why).
        assert vllm_nll[key] == pytest.approx(value, abs=1e-3, rel=2e-3 if torch.cuda.is_available() else None), key
    assert {("s", "reverse_kl", "t"), ("s", "forward_kl", "t")} <= set(values(reports["vllm"], "kl"))
    assert any(metric.startswith("pass") for _, metric, _ in values(reports["vllm"], "arith"))
