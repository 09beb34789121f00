#!/usr/bin/env python3
"""Every stage of serving a Kimi Linear student with vLLM on a GPU, each failure reported in full:
tests/gpu/test_vllm_kimi_cuda.py's stages (export, engine, prompt logprobs against transformers,
greedy tokens, in-place weight sync) run one after another, each in its own try, so one device
call shows all that breaks, not only the first thing.

    python3 tools/vllm_gpu/kimi_probe.py SUMMARY.json      (on the GPU machine, with the vLLM bundle)

Prints "KIMI-VLLM: ..." lines and each failure's traceback; writes SUMMARY.json: the environment,
then per stage its status (ok / failed / skipped), seconds, measurements and, for a failure, the
traceback. If the engine does not start with vLLM's own choice of MLA backend, it is started again
with TRITON_MLA (both attempts reported). Exit status 0 when every stage that ran passed the GPU
test's checks, 1 otherwise.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.gpu import test_vllm_kimi_cuda as kimi  # noqa: E402


def run_stage(summary: dict, name: str, fn, state: dict, needs: tuple[str, ...] = ()) -> bool:
    """Run `fn(state)` as stage `name` unless a stage in `needs` is not ok; its returned dict
    (`passed: False` marks a failed check) goes into `summary`; an exception is printed and
    recorded, never raised. True when the stage is ok."""
    record = summary[name] = {}
    missing = [n for n in needs if summary.get(n, {}).get("status") != "ok"]
    if missing:
        record["status"] = f"skipped: needs {missing}"
    else:
        started = time.perf_counter()
        try:
            record.update(fn(state) or {})
            record["status"] = "ok" if record.pop("passed", True) else "failed"
        except BaseException as error:  # noqa: BLE001 (a probe reports everything, even a SystemExit)
            record |= {"status": "failed", "error": f"{type(error).__name__}: {error}",
                       "traceback": traceback.format_exc()}
            print(record["traceback"], flush=True)
        record["seconds"] = round(time.perf_counter() - started, 1)
    shown = {k: v for k, v in record.items() if k != "traceback"}
    print(f"KIMI-VLLM: {name}: {json.dumps(shown, default=str)[:3000]}", flush=True)
    return record["status"] == "ok"


def environment() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "gpu": torch.cuda.is_available() and torch.cuda.get_device_name(0),
           "capability": torch.cuda.is_available() and list(torch.cuda.get_device_capability(0)),
           "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "K3POST_"))}}
    for module in ("vllm", "transformers", "triton", "fla"):
        try:
            out[module] = __import__(module).__version__
        except Exception as error:  # noqa: BLE001
            out[module] = f"unavailable: {type(error).__name__}: {error}"
    return out


def export(state: dict) -> dict:
    from k3post.model.export.kimi_export import export_kimi_for_vllm  # noqa: PLC0415

    model = kimi.build_student()
    margin = kimi.router_margin(model, kimi.prompts())
    state["path"] = export_kimi_for_vllm(model, None, state["work"] / "export", dtype=torch.bfloat16)
    state["model"] = model
    return {"router_margin_fp32": margin, "files": sorted(p.name for p in state["path"].iterdir()),
            "config": json.loads((state["path"] / "config.json").read_text()), "passed": margin > 0.02}


def hf_on_gpu(state: dict) -> dict:
    state["model"] = state["model"].to("cuda", torch.bfloat16)
    logprobs = torch.cat([kimi.hf_prompt_logprobs(state["model"], ids) for ids in kimi.prompts()])
    return {"mean_prompt_logprob": float(logprobs.mean()),
            "router_margin_bf16": kimi.router_margin(state["model"], kimi.prompts())}


def engine(backend: str | None):
    def start(state: dict) -> dict:
        state["llm"] = kimi.start_engine(state["path"], backend=backend)
        return {"backend": backend or os.environ.get("K3POST_KIMI_MLA_BACKEND") or "vLLM's choice",
                "layers": state["llm"].collective_rpc(kimi.engine_layers)[0]}
    return start


def prompt_logprobs(state: dict) -> dict:
    gap, mean = kimi.prompt_logprob_gap(state["llm"], state["model"], kimi.prompts())
    return {"max_abs_diff": gap, "mean_abs_diff": mean, "tol": kimi.TOL, "mean_tol": kimi.MEAN_TOL,
            "passed": gap < kimi.TOL and mean < kimi.MEAN_TOL}


def greedy(state: dict) -> dict:
    counts = kimi.greedy_disagreements(state["llm"], state["model"], kimi.prompts(seed=1)[:3])
    return counts | {"passed": counts["disagree"] == 0 and counts["agree"] >= 40}


def sync(state: dict) -> dict:
    model, sequences = state["model"], kimi.prompts(seed=2)
    before = [kimi.hf_prompt_logprobs(model, ids) for ids in sequences]
    kimi.perturb(model)
    moved = max(float((kimi.hf_prompt_logprobs(model, ids) - b).abs().max()) for ids, b in zip(sequences, before))
    margin = kimi.router_margin(model, sequences)
    missed = kimi.sync_into_engine(state["llm"], model)
    gap, mean = kimi.prompt_logprob_gap(state["llm"], model, sequences)
    return {"hf_moved": moved, "router_margin": margin, "unwritten": missed, "max_abs_diff": gap,
            "mean_abs_diff": mean, "passed": not missed and moved > 5 * kimi.TOL and margin > 0.02
            and gap < kimi.TOL and mean < kimi.MEAN_TOL}


def main(summary_path: Path) -> int:
    summary: dict = {"environment": environment()}
    print(f"KIMI-VLLM: environment {json.dumps(summary['environment'])}", flush=True)
    stages = summary["stages"] = {}
    state: dict = {"work": Path(tempfile.mkdtemp(prefix="kimi-probe-"))}
    run_stage(stages, "export", export, state)
    run_stage(stages, "hf_on_gpu", hf_on_gpu, state, needs=("export",))
    run_stage(stages, "engine", engine(None), state, needs=("export",))
    if stages["engine"]["status"] == "failed":
        run_stage(stages, "engine_triton_mla", engine("TRITON_MLA"), state)
    stages["engine_any"] = {"status": "ok" if "llm" in state else "failed"}
    comparing = ("engine_any", "hf_on_gpu")
    run_stage(stages, "a_prompt_logprobs", prompt_logprobs, state, needs=comparing)
    run_stage(stages, "b_greedy", greedy, state, needs=comparing)
    run_stage(stages, "c_sync", sync, state, needs=comparing)
    summary_path.write_text(json.dumps(summary, indent=2, default=str))
    print(f"KIMI-VLLM: summary written to {summary_path}", flush=True)
    # the first engine attempt may fail if the TRITON_MLA one then serves: that is a finding, not a failure
    failed = [n for n, s in stages.items() if s["status"] == "failed" and not (n == "engine" and "llm" in state)]
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(Path(sys.argv[1])))
