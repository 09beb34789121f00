"""A teacher fleet on one GPU: three vLLM teachers taking turns in sleep mode against one resident teacher.

Three teachers that cannot be awake together in the GPU memory left free (here: what a ballast
tensor leaves, standing for the learner and the sampler; room for one awake engine and for what
each sleeping one keeps, ~1 GiB) can still score on one GPU if each is
woken for its share of the batch and put back to sleep (`vllm.sleep`; loops/routing.py asks the
teachers in turn, each once per step). The scoring work is the same in both arms: the batch's
rows split between the three teachers, or all scored by one teacher that stays awake.

    fleet      3 engines, each its own copy of the teacher, asleep between turns (its first
               sleep copies the weights to pinned host memory, kept; later sleeps copy nothing,
               and each wake copies the kept copy back; KV cache freed: engine/vllm/sleep.py)
    resident   1 engine, awake throughout, scoring every row

Per arm: the median seconds of the score phase (`score_for_learner`, as the loop calls it) over
--steps after one warm-up step, and for the fleet each teacher's wake and sleep seconds. The
ratio fleet ÷ resident is the cost of the turns. What bounds it: a turn moves the teacher's
weights to the GPU over PCIe (2 bytes per parameter; before commit a12b7c5 back again too, at every
sleep), scoring moves none and
computes 2 FLOP per parameter per token, so the turns hide behind the scoring only for
batches of tens of thousands of tokens per teacher.

    python3 bench/engines/teacher_fleet_gpu.py --tokenizer /tmp/smol-tok [--batch 32] [--steps 3]

The teacher is the 1.39B Qwen2 of bench/opd/opd_step_gpu.py (random weights, bf16), saved once;
rows are the built-in chat prompts with random completions of --new-tokens tokens. With it the
three engines' footprints (weights, KV cache, activations) exceed the free memory, their weights
alone do not; `--hidden 4096 --layers 32` (a ~7B teacher) makes the weights alone exceed it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.opd.opd_step_gpu import SHAPES, save_random_model  # noqa: E402
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "A teacher fleet on one GPU: three vLLM teachers in turn against one resident (`bench/engines/teacher_fleet_gpu.py`)"
NAMES = ("t0", "t1", "t2")
ASLEEP_GIB = 1.25  # what a sleeping engine still holds of the GPU, with a margin (measured: 1.07 GiB)


def rollouts_for(tokenizer_dir: Path, batch: int, new_tokens: int, teachers: tuple[str, ...]):
    """`batch` rows of the built-in chat prompts (chat template), random completions, rows dealt to
    `teachers` in turn."""
    from transformers import AutoTokenizer  # noqa: PLC0415

    from k3post.data.builtin_prompts import builtin_prompt_set  # noqa: PLC0415
    from k3post.types import Prompt, Rollouts  # noqa: PLC0415

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = builtin_prompt_set("chat")[:batch]
    prompts = [Prompt(str(i), "chat", teachers[i % len(teachers)], (("user", row["prompt"]),)) for i, row in enumerate(rows)]
    prompt_ids = [list(tokenizer.apply_chat_template(p.as_chat(), add_generation_prompt=True, tokenize=True,
                                                     return_dict=True)["input_ids"]) for p in prompts]
    completions = torch.randint(1000, 40000, (len(prompts), new_tokens), generator=torch.Generator().manual_seed(0))
    return Rollouts(prompts, prompt_ids, completions, torch.ones(completions.shape), torch.zeros(completions.shape))


def teacher(name: str, path: Path, sleep: bool, share: float, kv_gib: float):
    from k3post.config.schema import ModelSpec, ResourceSpec, TeacherSpec, VllmSpec  # noqa: PLC0415
    from k3post.engine.teachers.vllm_teacher import VLLMTeacher  # noqa: PLC0415
    from k3post.launch.in_process import LocalTeacher  # noqa: PLC0415

    vllm = VllmSpec(dtype="bfloat16", max_model_len=1024, gpu_memory_utilization=0.9, kv_cache_gib=kv_gib,
                    sleep=sleep, enforce_eager=True)
    spec = TeacherSpec(model=ModelSpec(path=str(path), dtype="bfloat16"), engine="vllm", vllm=vllm,
                       resources=ResourceSpec(num_gpus=share))
    return LocalTeacher(VLLMTeacher(name, spec))


def timed_scores(teachers: dict, rollouts, steps: int) -> list[float]:
    """Seconds of each score phase after one warm-up, every teacher of `teachers` in turn."""
    from k3post.loops.routing import score_for_learner  # noqa: PLC0415

    scoring = {name: ("score", ()) for name in teachers}
    in_turn = frozenset(teachers) if len(teachers) > 1 else frozenset()
    seconds = []
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        score_for_learner(teachers, scoring, rollouts, in_turn)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="/tmp/smol-tok")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=2.0)
    parser.add_argument("--hidden", type=int, help="another teacher width (heads of 128, MLP 4×), e.g. 4096")
    parser.add_argument("--layers", type=int, help="another teacher depth")
    add_no_record(parser)
    args = parser.parse_args()
    from k3post.engine.common import quiet_libraries  # noqa: PLC0415

    quiet_libraries()
    total = torch.cuda.get_device_properties(0).total_memory
    with tempfile.TemporaryDirectory() as tmp:
        hidden, layers, mlp, heads, kv = SHAPES["teacher"]
        shape = (args.hidden or hidden, args.layers or layers, 4 * args.hidden if args.hidden else mlp,
                 args.hidden // 128 if args.hidden else heads, kv)
        path, params = save_random_model("teacher", shape, Path(args.tokenizer), Path(tmp), "cuda")
        weights = 2 * params
        torch.cuda.empty_cache()  # the saved model's memory back to the driver before measuring what is free
        # Free memory for one awake teacher and its KV cache with room to spare, not for three; and
        # for what each engine keeps while asleep (its process's CUDA context and what vLLM holds
        # outside its sleep pool: 1.07 GiB each on an H100, vLLM 0.26.0, 2026-12-07).
        free_wanted = int(1.6 * weights + (args.kv_gib + 2 + ASLEEP_GIB * len(NAMES)) * 2**30)
        ballast = torch.empty(max(torch.cuda.mem_get_info()[0] - free_wanted, 0), dtype=torch.uint8, device="cuda")
        # What one awake engine may use (vLLM asks for 0.9 of its share, which must be free when it
        # starts, beside the engines already asleep and its own process's CUDA context).
        share = min((1.6 * weights + (args.kv_gib + 2) * 2**30) / total / 0.9, 1.0)
        print(f"teacher {params / 1e9:.2f}B ({weights / 2**30:.1f} GiB); ballast {ballast.numel() / 2**30:.1f} GiB; "
              f"free {torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB for three teachers of {3 * weights / 2**30:.1f}",
              flush=True)
        started = time.perf_counter()
        fleet = {name: teacher(name, path, True, share, args.kv_gib) for name in NAMES}
        print(f"fleet built in {time.perf_counter() - started:.0f} s", flush=True)
        # each engine's first sleep, at its build: the one that copies the weights to the host
        first = statistics.mean(group.prefix_counts().result().get("sleep_s", 0.0) for group in fleet.values())
        fleet_s = timed_scores(fleet, rollouts_for(Path(args.tokenizer), args.batch, args.new_tokens, NAMES), args.steps)
        counts = {name: group.prefix_counts().result() for name, group in fleet.items()}
        del fleet
        resident = {"t0": teacher("t0", path, False, share, args.kv_gib)}
        resident_s = timed_scores(resident, rollouts_for(Path(args.tokenizer), args.batch, args.new_tokens, ("t0",)),
                                  args.steps)
    fleet_med, resident_med = statistics.median(fleet_s), statistics.median(resident_s)
    turns = 3 * (args.steps + 1)
    wake = statistics.mean(c.get("wake_s", 0.0) for c in counts.values()) / (args.steps + 1)
    sleep = statistics.mean(c.get("sleep_s", 0.0) for c in counts.values()) / (args.steps + 1)
    print(f"| arm | score phase s |\n|---|---|\n| fleet (3 in turn) | {fleet_med:.3f} |\n| resident | {resident_med:.3f} |")
    print(f"fleet / resident {fleet_med / resident_med:.2f}; per turn: wake {wake:.3f} s, sleep {sleep:.3f} s "
          f"({turns} turns); the first sleep (host copy made) {first:.3f} s")
    gpu = torch.cuda.get_device_name().removeprefix("NVIDIA ")
    head = f"{gpu}, {params / 1e9:.2f}B teacher, batch {args.batch} × {args.new_tokens} tokens"
    rows = [{"metric": f"{head}: score phase, three teachers in turn (sleep mode)", "value": rounded(fleet_med, 3),
             "unit": "s"},
            {"metric": f"{head}: score phase, one resident teacher", "value": rounded(resident_med, 3), "unit": "s"},
            {"metric": f"{head}: fleet against resident", "value": rounded(fleet_med / resident_med, 2), "unit": "×",
             "ratio_to": f"one resident teacher ({resident_med:.3f} s)"},
            {"metric": f"{head}: one teacher's wake", "value": rounded(wake, 3), "unit": "s"},
            {"metric": f"{head}: one teacher's sleep", "value": rounded(sleep, 3), "unit": "s"},
            {"metric": f"{head}: a teacher's first sleep, which copies its weights to the host (at its build)",
             "value": rounded(first, 3), "unit": "s"}]
    record_and_say("teacher-fleet-gpu", rows, args.no_record, source_section=SECTION,
                   command_="python3 bench/engines/teacher_fleet_gpu.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
