"""Seconds per OPD step: k3post against TRL's GKDTrainer on the same CPU, models and batch.

Each arm runs in a fresh process of its own, one after the other:

- k3post in process (`build_distill_run` + `distill_step`, as bench/opd/opd_step.py): sample, teacher
  score, learner step (full-vocabulary reverse KL), weight sync; its process starts with the
  host-allocator settings every k3post Ray actor gets (engine/host_memory.py);
  `k3post-glibc-defaults` without them; `k3post-before` with the learner's earlier step
  (two decoder forwards per micro-batch) patched back in;
- TRL `trl.experimental.gkd.GKDTrainer` (the optional `bench` extra), fully on-policy (λ = 1),
  β = 1 (reverse KL) and β = 0.5 (JSD), sampling temperature 1, 48 new tokens, one batch of 8:
  generation (`generate_on_policy_outputs`), the teacher's forward, and the rest of the step
  (student forward, loss, backward, clip, AdamW); as TRL ships (glibc's defaults), and
  `trl-b1-tuned-alloc` with k3post's allocator settings (the engines compared on equal terms).

    .venv/bin/python bench/opd/opd_vs_trl_step.py                      # recipes/bench/speed-chat.yaml, 1 warm-up + 4 steps
    .venv/bin/python bench/opd/opd_vs_trl_step.py --steps 2 --arms k3post,trl-b1

"learner s" is k3post's `time/train_s` and, for TRL, step − generation − teacher forward.

At the end each arm's step time, learner time and tokens a step, and the step-time ratios to
arm `trl-b1`, are appended to bench/results/opd-vs-trl.jsonl (`results.record`: date, commit,
machine and command filled in, the rows they replace marked "current": false); `--no-record`
leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from k3post.config.load import load_distill_recipe
from k3post.engine.common import quiet_libraries
from k3post.engine.host_memory import allocator_env
from k3post.model.scoring.logprobs import completion_full_logprobs, completion_logprobs

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "OPD step against TRL GKDTrainer, same CPU, models and batch (`bench/opd/opd_vs_trl_step.py`)"


def two_forward_policy_outputs(model, mb, pad_id, temperature, full, recording, compiled=False):
    """The learner's earlier policy pass: the sampled tokens' logprobs, then (full-vocab
    loss) the distributions from a second decoder forward over the same tokens (`compiled`, added
    to the learner's signature later, is not used: the eager head, as before)."""
    with recording():
        logprobs_BT = completion_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                          temperature)
    full_BTV = (completion_full_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                         temperature) if full else None)
    return logprobs_BT, full_BTV


@contextlib.contextmanager
def two_forward_learner():
    from k3post.engine.learner import learner_base  # noqa: PLC0415

    current = learner_base.policy_outputs
    learner_base.policy_outputs = two_forward_policy_outputs
    try:
        yield
    finally:
        learner_base.policy_outputs = current


def k3post_times(recipe, steps: int, before: bool) -> dict[str, float]:
    """Median wall seconds per phase and CPU seconds (this process, all threads) per step and per
    learner step, over `steps` in-process steps after one warm-up step."""
    from k3post.launch.distill import build_distill_run  # noqa: PLC0415
    from k3post.launch.in_process import InProcessBackend  # noqa: PLC0415
    from k3post.loops.distill import distill_step  # noqa: PLC0415

    learner_cpu: list[float] = []
    with two_forward_learner() if before else contextlib.nullcontext(), tempfile.TemporaryDirectory() as tmp:
        run = build_distill_run(recipe, Path(tmp), InProcessBackend())
        run.say = lambda _: None
        train_step = run.learner.train_step

        def timed_train_step(*args):
            started = time.process_time()
            out = train_step(*args)
            learner_cpu.append(time.process_time() - started)
            return out

        run.learner.train_step = timed_train_step
        run.weight_sync.push(0)
        rows, cpu = [], []
        for step in range(1, steps + 2):
            started = time.process_time()
            rows.append(distill_step(run, step))
            cpu.append(time.process_time() - started)
    med = lambda xs: statistics.median(xs[1:])  # noqa: E731  (step 1 is the warm-up)
    return {"sample": med([r["time/sample_s"] for r in rows]), "teacher": med([r["time/score_s"] for r in rows]),
            "learner": med([r["time/train_s"] for r in rows]), "step": med([r["time/step_s"] for r in rows]),
            "tokens": med([r["train/tokens"] for r in rows]), "cpu_step": med(cpu), "cpu_learner": med(learner_cpu)}


def trl_dataset(recipe, n: int, base_dir: Path):
    """`n` of the recipe's first source's prompts as TRL conversations, from the first on, started
    over when the source has fewer (every batch full); an empty assistant turn marks where the
    completion starts: the collator renders messages[:-1] with the generation prompt."""
    from datasets import Dataset  # noqa: PLC0415

    from k3post.data.sources import load_prompt_rows  # noqa: PLC0415

    rows = load_prompt_rows(recipe.data.sources[0].prompts, base_dir)
    convs = [[{"role": r, "content": c} for r, c in row["messages"]] + [{"role": "assistant", "content": ""}]
             for row in (rows[i % len(rows)] for i in range(n))]
    return Dataset.from_list([{"messages": m} for m in convs])


def gkd_config(recipe, beta: float, steps: int, output_dir: str, device: str):
    """TRL's config for `steps` + 1 fully on-policy (λ = 1) steps of the recipe's batch
    (prompts_per_step), new tokens, temperature and optimiser, on the CPU or the CUDA `device`;
    bf16 mixed precision, TRL's default (the models are bf16 already)."""
    from trl.experimental.gkd import GKDConfig  # noqa: PLC0415

    # gradient_checkpointing off: TRL 1.16's default (on) generates without the KV cache and
    # recomputes the forward in backward; k3post does neither (learner.activation_checkpointing is
    # off in the benchmarks' recipes), so both sides do the same work.
    return GKDConfig(output_dir=output_dir, per_device_train_batch_size=recipe.data.prompts_per_step,
                     max_steps=steps + 1, learning_rate=recipe.optim.lr, max_grad_norm=recipe.optim.grad_clip,
                     lmbda=1.0, beta=beta, temperature=recipe.sampling.temperature,
                     max_new_tokens=recipe.sampling.max_new_tokens, save_strategy="no", report_to=[],
                     use_cpu=not device.startswith("cuda"), bf16=True, logging_steps=1000, disable_tqdm=True,
                     seed=recipe.train.seed, dataloader_num_workers=0, gradient_checkpointing=False)


def trl_times(recipe, teacher_spec, beta: float, steps: int, base_dir: Path, device: str = "cpu") -> dict[str, float]:
    """Median phase times of `steps` GKDTrainer steps after one warm-up step, at the recipe's
    prompts_per_step and max_new_tokens. On a CUDA `device` (the Trainer's: cuda:0) it runs in bf16
    and waits for the GPU before every clock reading, so the times are the GPU's work, not its launches."""
    from transformers import TrainerCallback  # noqa: PLC0415
    from trl.experimental.gkd import GKDTrainer  # noqa: PLC0415

    from k3post.model.loading.load import load_model  # noqa: PLC0415

    student, tokenizer = load_model(recipe.student)
    teacher, _ = load_model(teacher_spec.model)
    gen_s, teacher_s, step_s, tokens, cpu_step, cpu_gen, cpu_teacher = [], [], [], [], [], [], []
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    class Timed(GKDTrainer):
        @staticmethod
        def generate_on_policy_outputs(model, inputs, generation_config):
            sync()
            started, cpu = time.perf_counter(), time.process_time()
            out = GKDTrainer.generate_on_policy_outputs(model, inputs, generation_config)
            sync()
            gen_s.append(time.perf_counter() - started)
            cpu_gen.append(time.process_time() - cpu)
            tokens.append(float((out[2] != -100).sum()))
            return out

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            sync()
            self.started, self.cpu = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            sync()
            step_s.append(time.perf_counter() - self.started)
            cpu_step.append(time.process_time() - self.cpu)

    clock = {}
    def before_teacher(*_):
        sync()
        clock.update(t=time.perf_counter(), c=time.process_time())

    def after_teacher(*_):  # returns None: the teacher's output is left as it is
        sync()
        teacher_s.append(time.perf_counter() - clock["t"])
        cpu_teacher.append(time.process_time() - clock["c"])

    teacher.register_forward_pre_hook(before_teacher)
    teacher.register_forward_hook(after_teacher)
    batch = recipe.data.prompts_per_step
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Timed(model=student, teacher_model=teacher, args=gkd_config(recipe, beta, steps, tmp, device),
                        processing_class=tokenizer, train_dataset=trl_dataset(recipe, batch * (steps + 1), base_dir),
                        callbacks=[StepTimer()])
        trainer.train()
    med = lambda xs: statistics.median(xs[1:])  # noqa: E731  (step 1 is the warm-up)
    return {"sample": med(gen_s), "teacher": med(teacher_s), "step": med(step_s),
            "learner": med(step_s) - med(gen_s) - med(teacher_s), "tokens": med(tokens), "cpu_step": med(cpu_step),
            "cpu_learner": med(cpu_step) - med(cpu_gen) - med(cpu_teacher)}


def trl_at(recipe, steps: int, base_dir: Path, device: str) -> dict[str, float]:
    """TRL GKDTrainer's median phase times (β = 1, λ = 1) at the recipe's batch and new tokens (on
    the recipe's saved student and first teacher), and its student tokens/s: the completion tokens
    it trained on a step over its step time (as bench/opd/opd_step_gpu.py's `tokens/s`). For
    bench/opd/opd_step_gpu.py --trl: the models of the run before leave the GPU first."""
    import gc  # noqa: PLC0415

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    r = trl_times(recipe, next(iter(recipe.teachers.values())), 1.0, steps, base_dir, device=device)
    r["tokens/s"] = r["tokens"] / r["step"]
    print(f"TRL GKDTrainer, batch {recipe.data.prompts_per_step}: {json.dumps(r)}", flush=True)
    return r


def trl_rows(results: list[dict], trl: dict[int, dict], gpu: str) -> list[dict]:
    """bench/results rows of bench/opd/opd_step_gpu.py --trl (its `summarize()` dicts, and `trl_at`'s
    per batch): per batch TRL's step, and per batch and mode TRL's step over k3post's (how many
    times as fast k3post's is)."""
    rows = [{"metric": f"TRL GKDTrainer (β = 1, λ = 1) on one {gpu}, batch {b}, same models and new tokens: step",
             "value": rounded(t["step"], 3), "unit": "s"} for b, t in trl.items()]
    for r in results:
        t = trl[r["batch"]]
        rows.append({"metric": f"in-process, batch {r['batch']}, {r['mode']}: OPD step speed-up over TRL "
                               "GKDTrainer's in the same process (TRL's step ÷ k3post's)",
                     "value": rounded(t["step"] / r["step"], 1), "unit": "×",
                     "ratio_to": f"TRL GKDTrainer, batch {r['batch']} ({t['step']:.2f} s a step)"})
    return rows


def print_trl_table(results: list[dict], trl: dict[int, dict], steps: int, new_tokens: int) -> None:
    """bench/opd/opd_step_gpu.py --trl's table: each k3post step beside TRL's phases at its batch."""
    print(f"\nTRL GKDTrainer (β = 1, λ = 1), same process, saved models and {new_tokens} new tokens, median of "
          f"{steps} steps after 1 warm-up; TRL's learner s = step − generation − teacher; speed = TRL's step ÷ "
          "k3post's")
    print("| batch | k3post mode | k3post step s | TRL step s | TRL generation s | TRL teacher s | TRL learner s | "
          "tokens/step (k3post / TRL) | student tok/s (k3post / TRL) | k3post ÷ TRL speed |")
    print("|" + "---|" * 10)
    for r in results:
        t = trl[r["batch"]]
        print(f"| {r['batch']} | {r['mode']} | {r['step']:.3f} | {t['step']:.3f} | {t['sample']:.3f} | "
              f"{t['teacher']:.3f} | {t['learner']:.3f} | {r['tokens/step']:.0f} / {t['tokens']:.0f} | "
              f"{r['tokens/s']:,.0f} / {t['tokens/s']:,.0f} | {t['step'] / r['step']:.1f}× |")


ARMS = ("k3post", "k3post-glibc-defaults", "k3post-before", "trl-b1", "trl-b1-tuned-alloc", "trl-b0.5")
DEFAULT_ARMS = "k3post,k3post-glibc-defaults,trl-b1,trl-b1-tuned-alloc"


def arm_env(arm: str) -> dict[str, str]:
    """The environment an arm's process starts with: k3post's as its Ray actors get it (the
    host-allocator settings, engine/host_memory.py), TRL's as TRL ships (glibc's defaults); the
    `-glibc-defaults` / `-tuned-alloc` arms swap them, to show what the allocator alone is worth."""
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    tuned = (arm.startswith("k3post") and not arm.endswith("-glibc-defaults")) or arm.endswith("-tuned-alloc")
    return {**env, **allocator_env()} if tuned else env


def run_arm(arm: str, recipe, recipe_path: str, steps: int) -> dict[str, float]:
    if arm.startswith("trl-"):
        beta = float(arm.removeprefix("trl-b").removesuffix("-tuned-alloc"))
        return trl_times(recipe, next(iter(recipe.teachers.values())), beta, steps, Path(recipe_path).parent)
    return k3post_times(recipe, steps, before=arm == "k3post-before")


def run_arm_process(arm: str, args) -> dict[str, float]:
    """One arm in a fresh process of its own (no arm inherits another's heap), its env as above."""
    cmd = [sys.executable, __file__, args.recipe, "--steps", str(args.steps), "--child", arm]
    done = subprocess.run(cmd, env=arm_env(arm), capture_output=True, text=True)
    results = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not results:
        raise SystemExit(f"arm {arm} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(results[-1].removeprefix("RESULT "))


def main() -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", nargs="?", default="recipes/bench/speed-chat.yaml")
    parser.add_argument("--steps", type=int, default=4, help="timed steps after one warm-up step")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # run one arm here and print its figures
    add_no_record(parser)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_arm(args.child, load_distill_recipe(args.recipe), args.recipe, args.steps)))
        return 0
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    results, started = {}, datetime.now(timezone.utc)
    for arm in args.arms.split(","):
        results[arm] = run_arm_process(arm, args)
        print(arm, {k: round(v, 2) for k, v in results[arm].items()}, flush=True)
    print_table(args, results)
    notes = (f"{started:%H:%M}-{datetime.now(timezone.utc):%H:%M} UTC, each arm in its own process, median of "
             f"{args.steps} steps after 1 warm-up; {args.recipe}")
    record_and_say("opd-vs-trl", result_rows(results, notes), args.no_record, source_section=SECTION)
    return 0


HEADLINE = "CPU: OPD step time, k3post against TRL GKDTrainer (β = 1), each as it ships, same models and batch"


def result_rows(results: dict[str, dict[str, float]], notes: str | None = None) -> list[dict]:
    """bench/results rows of a run: per arm its step time, learner time (2 decimals, as the table)
    and tokens a step; each arm's step time against arm `trl-b1`'s (k3post's is the headline
    ratio), and k3post's against `trl-b1-tuned-alloc`'s (the two on equal allocator settings)."""
    rows = []
    for arm, r in results.items():
        rows += [{"metric": f"CPU, arm `{arm}`: step time", "value": rounded(r["step"], 2), "unit": "s"},
                 {"metric": f"CPU, arm `{arm}`: learner time", "value": rounded(r["learner"], 2), "unit": "s"},
                 {"metric": f"CPU, arm `{arm}`: tokens a step", "value": round(r["tokens"]), "unit": "tokens"}]
    ref = results.get("trl-b1")
    for arm, r in results.items() if ref else ():
        if arm == "k3post":
            rows.append({"metric": HEADLINE, "value": rounded(r["step"] / ref["step"], 2), "unit": "×",
                         "ratio_to": f"TRL's step (arm `trl-b1`, {ref['step']:.2f} s)"})
        elif arm != "trl-b1":
            rows.append({"metric": f"CPU, arm `{arm}`: step time against arm `trl-b1`'s",
                         "value": rounded(r["step"] / ref["step"], 2), "unit": "×", "ratio_to": "arm `trl-b1`"})
    tuned = results.get("trl-b1-tuned-alloc")
    if tuned and "k3post" in results:
        rows.append({"metric": "CPU: k3post's step time against TRL's on equal allocator settings",
                     "value": rounded(results["k3post"]["step"] / tuned["step"], 2), "unit": "×",
                     "ratio_to": f"arm `trl-b1-tuned-alloc` ({tuned['step']:.2f} s)"})
    return [{**row, "notes": notes} for row in rows]


def print_table(args, results: dict[str, dict[str, float]]) -> None:
    print(f"\nOPD step, {args.recipe}: median of {args.steps} steps after 1 warm-up; torch threads "
          f"{torch.get_num_threads()}. Wall seconds per phase; CPU seconds of this process (all threads) per step "
          "and per learner step (on a shared machine the CPU seconds are the steadier figure)")
    print("| arm | sample s | teacher s | learner s | step s | CPU s/step | learner CPU s | tokens/step "
          "| step / TRL β=1 | CPU step / TRL β=1 | learner CPU / TRL β=1 |")
    print("|" + "---|" * 11)
    ref = results.get("trl-b1")
    for arm, r in results.items():
        ratios = [f"{r[k] / ref[k]:.2f}x" if ref else "-" for k in ("step", "cpu_step", "cpu_learner")]
        print(f"| {arm} | {r['sample']:.2f} | {r['teacher']:.2f} | {r['learner']:.2f} | {r['step']:.2f} | "
              f"{r['cpu_step']:.2f} | {r['cpu_learner']:.2f} | {r['tokens']:.0f} | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    sys.exit(main())
