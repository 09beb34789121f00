"""vLLM on one GPU against k3post's own engines: decode speed, weight sync, sleep and wake.

The student is the 0.40B Qwen2 of bench/opd/opd_step_gpu.py (random weights, bf16, the SmolLM2
vocabulary from --tokenizer). One run, side by side:

1. decode tokens/s at each batch of --batches, --new-tokens new tokens at temperature 1, the
   built-in chat prompts: k3post's static-cache sampler compiled with CUDA graphs
   (`sampling: {cache: static, compile: true}`) against the vLLM sampler (CUDA graphs, its core
   in this process); one warm-up call per batch, then the median of --repeats;
2. the weight sync into vLLM of the student's live CUDA tensors, seconds per GB (median of
   --repeats), every tensor checksummed on arrival and compared with the sender's
   (engine/transport/weight_check.py): into the engine above (its core in this process: by
   reference), into an engine whose core runs in a process of its own (CUDA IPC handles), and
   into the same from host copies (what the object store hands a sampler actor); each by the
   direct load k3post takes on CUDA and, beside it, by vLLM's layer-wise reload, and once
   without checksums (what the check costs);
3. vLLM's sleep mode on that second engine: seconds to sleep and to wake, and the GPU memory
   it hands back (engine/vllm/sleep.py).

    python bench/engines/vllm_gpu.py --tokenizer .gpu-tokenizer
    python bench/engines/vllm_gpu.py --tokenizer .gpu-tokenizer --batches 1,8 --new-tokens 32 --no-record
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "vLLM on one GPU: decode, weight sync, sleep mode (`bench/engines/vllm_gpu.py`)"


def prompts(batch: int):
    from k3post.data.builtin_prompts import builtin_prompt_set  # noqa: PLC0415
    from k3post.types import Prompt  # noqa: PLC0415

    rows = builtin_prompt_set("chat")
    return [Prompt(str(i), "chat", "t", (("user", rows[i % len(rows)]["prompt"]),)) for i in range(batch)]


def decode_rate(sampler, batch: int, new_tokens: int, repeats: int) -> float:
    """Median generated tokens/s of `repeats` calls after one warm-up call at the same batch."""
    import torch  # noqa: PLC0415

    from k3post.types import SamplingParams  # noqa: PLC0415

    rates, batch_prompts = [], prompts(batch)
    for i in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        out = sampler.sample(batch_prompts, SamplingParams(new_tokens, 1.0, 1.0, seed=i))
        torch.cuda.synchronize()
        if i:
            rates.append(out.num_tokens() / (time.perf_counter() - started))
    return statistics.median(rates)


def timed_syncs(llm, weights: dict, repeats: int, checked: bool = True, direct: bool = True) -> tuple[float, bool, str]:
    """Median seconds of `repeats` syncs of `weights` (every tensor checked on arrival, unless not
    `checked`); whether all checksums matched; the path the sync took ("direct" or "reload")."""
    import torch  # noqa: PLC0415

    from k3post.engine.transport.weight_check import checksums  # noqa: PLC0415
    from k3post.engine.vllm.vllm_engine import last_sync_path, load_weights_in_place, received_checksums  # noqa: PLC0415

    names, seconds = tuple(weights) if checked else (), []
    for _ in range(repeats):
        started = time.perf_counter()
        load_weights_in_place(llm, weights, names, allow_direct=direct)
        seconds.append(time.perf_counter() - started)
    received = received_checksums(llm)
    same = received == checksums({n: torch.as_tensor(weights[n]) for n in names})
    return statistics.median(seconds), same, last_sync_path(llm)


def measure(args, student: Path) -> dict:
    import torch  # noqa: PLC0415

    from k3post.config.schema import ModelSpec, VllmSpec  # noqa: PLC0415
    from k3post.engine.samplers.fast_sampler import FastHFSampler  # noqa: PLC0415
    from k3post.engine.samplers.vllm_sampler import VLLMSampler  # noqa: PLC0415
    from k3post.model.training.weights import unique_state  # noqa: PLC0415

    spec, batches, out = ModelSpec(path=str(student), dtype="bfloat16"), [int(b) for b in args.batches.split(",")], {}
    hf = FastHFSampler(spec, device="cuda", compile=True)
    out["static"] = {b: decode_rate(hf, b, args.new_tokens, args.repeats) for b in batches}
    weights = {name: t.detach() for name, t in unique_state(hf.model).items()}  # live CUDA tensors, as a learner's
    out["gb"] = sum(t.numel() * t.element_size() for t in weights.values()) / 1e9
    engine = VllmSpec(dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.3)
    vllm = VLLMSampler(spec, engine, num_gpus=1)
    out["vllm"] = {b: decode_rate(vllm, b, args.new_tokens, args.repeats) for b in batches}
    out["in_process"] = timed_syncs(vllm.llm, weights, args.repeats)
    out["in_process_unchecked"] = timed_syncs(vllm.llm, weights, args.repeats, checked=False)
    out["in_process_reload"] = timed_syncs(vllm.llm, weights, args.repeats, direct=False)
    vllm.llm.llm_engine.engine_core.shutdown()  # its reservation stays mapped until the process ends: 0.3 of the GPU
    del vllm
    sleeping = VLLMSampler(spec, engine.model_copy(update={"sleep": True}), num_gpus=1)
    sleeping.sleeper.wake()
    out["ipc"] = timed_syncs(sleeping.llm, weights, args.repeats)
    out["ipc_reload"] = timed_syncs(sleeping.llm, weights, args.repeats, direct=False)
    host = {name: t.cpu() for name, t in weights.items()}
    out["host"] = timed_syncs(sleeping.llm, host, args.repeats)
    sleeps, wakes, freed = [], [], []
    for _ in range(args.repeats):
        awake = torch.cuda.mem_get_info()[0]
        started = time.perf_counter()
        sleeping.sleeper.sleep()
        sleeps.append(time.perf_counter() - started)
        freed.append((torch.cuda.mem_get_info()[0] - awake) / 2**30)
        started = time.perf_counter()
        sleeping.sleeper.wake()
        wakes.append(time.perf_counter() - started)
    out["sleep"] = (statistics.median(sleeps), statistics.median(wakes), statistics.median(freed))
    return out


def result_rows(m: dict, gpu: str, new_tokens: int) -> list[dict]:
    """bench/results rows of a run (`measure`'s dict)."""
    rows = []
    for batch, rate in m["vllm"].items():
        head = f"0.40B student on one {gpu}, batch {batch}, {new_tokens} new tokens"
        rows += [{"metric": f"{head}: vLLM sampler tokens/s", "value": round(rate), "unit": "tokens/s"},
                 {"metric": f"{head}: vLLM against the compiled static sampler", "value": rounded(rate / m["static"][batch], 2),
                  "unit": "×", "ratio_to": f"static sampler, CUDA graphs ({m['static'][batch]:,.0f} tokens/s)"}]
    for key, what in (("in_process", "into a vLLM engine in this process (by reference)"),
                      ("in_process_unchecked", "into a vLLM engine in this process (by reference), no checksums"),
                      ("in_process_reload", "into a vLLM engine in this process (by reference), vLLM's layer-wise reload"),
                      ("ipc", "into a vLLM engine in its own process (CUDA IPC)"),
                      ("ipc_reload", "into a vLLM engine in its own process (CUDA IPC), vLLM's layer-wise reload"),
                      ("host", "into a vLLM engine in its own process from host copies")):
        seconds, same, path = m[key]
        checked = "" if key.endswith("unchecked") else ", every tensor checked"
        rows.append({"metric": f"weight sync of {m['gb']:.2f} GB {what}{checked}: seconds per GB",
                     "value": rounded(seconds / m["gb"], 3), "unit": "s/GB",
                     "notes": f"{path} load; " + ("no checksums taken" if not checked else
                                                   "every checksum matched" if same else "A CHECKSUM DIFFERED")})
    sleep_s, wake_s, freed = m["sleep"]
    rows += [{"metric": f"vLLM sleep mode, 0.40B student: sleep (weights to host, KV cache freed) on one {gpu}",
              "value": rounded(sleep_s, 3), "unit": "s", "notes": f"{freed:.1f} GiB handed back"},
             {"metric": f"vLLM sleep mode, 0.40B student: wake on one {gpu}", "value": rounded(wake_s, 3), "unit": "s"}]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default=".gpu-tokenizer", help="a directory with the SmolLM2 tokenizer files")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    add_no_record(parser)
    args = parser.parse_args()
    import torch  # noqa: PLC0415

    from bench.opd.opd_step_gpu import SHAPES, save_random_model  # noqa: PLC0415
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415

    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU")
    quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        student, _ = save_random_model("student", SHAPES["student"], Path(args.tokenizer), Path(tmp), "cuda")
        m = measure(args, student)
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ")
    rows = result_rows(m, gpu, args.new_tokens)
    print("\n| batch | static sampler tok/s | vLLM tok/s | vLLM ÷ static |\n|---|---|---|---|")
    for b in m["vllm"]:
        print(f"| {b} | {m['static'][b]:,.0f} | {m['vllm'][b]:,.0f} | {m['vllm'][b] / m['static'][b]:.2f} |")
    for row in rows[2 * len(m["vllm"]):]:
        print(f"{row['metric']}: {row['value']} {row['unit']} {row.get('notes') or ''}")
    record_and_say("vllm-gpu", rows, args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
