"""`k3post run`: load the recipe, prepare the run directory, start the engines, run the loop."""

from __future__ import annotations

import time
from pathlib import Path

from k3post.config.load import load_run_recipe
from k3post.track.run_dir import prepare_run_dir


def _summary(history: list[dict], teachers: list[str]) -> list[str]:
    evals = [h for h in history if any(k.startswith("eval/kl/") for k in h)]
    if len(evals) < 2:
        return []
    first, last = evals[0], evals[-1]
    lines = [f"held-out KL, step {first['step']} → step {last['step']}:"]
    for name in teachers:
        for key, label in ((f"eval/kl/{name}", "reverse KL(student‖teacher)"),
                           (f"eval/fkl/{name}", "forward KL(teacher‖student)")):
            a, b = first.get(key), last.get(key)
            if a is not None and b is not None:
                change = 100 * (b - a) / a if a else 0.0
                lines.append(f"  {name:>10} {label}: {a:.3f} → {b:.3f} ({change:+.0f}%)")
    return lines


def _first_and_last_eval(history: list[dict], key: str) -> tuple[dict, dict] | None:
    """The first and last logged rows that hold `key` (None unless there are two)."""
    evals = [h for h in history if key in h]
    return (evals[0], evals[-1]) if len(evals) >= 2 else None


def _sft_summary(history: list[dict], recipe) -> list[str]:
    ends = _first_and_last_eval(history, "eval/nll")
    if ends is None:
        return []
    a, b = ends
    return [f"held-out NLL, step {a['step']} → step {b['step']}: {a['eval/nll']:.4f} → {b['eval/nll']:.4f} "
            f"({100 * (b['eval/nll'] - a['eval/nll']) / a['eval/nll']:+.0f}%)"]


def _distill_plan():
    from k3post.dist.launch import build_in_process, build_on_ray, cpus_needed  # noqa: PLC0415
    from k3post.dist.launch_rl import reward_model_cpus, with_rewards  # noqa: PLC0415
    from k3post.loops.distill import run_distill  # noqa: PLC0415
    from k3post.loops.distill_async import run_distill_async  # noqa: PLC0415

    loops = {"sync": run_distill, "async": run_distill_async}  # train.mode: one loop function per mode

    # Sources that name rewards add a reward scorer (and reward-model actors) to the OPD run.
    return (lambda r, d: with_rewards(build_in_process(r, d), on_ray=False),
            lambda r, d: with_rewards(build_on_ray(r, d), on_ray=True),
            lambda run: loops[run.recipe.train.mode](run),
            lambda r: cpus_needed(r) + reward_model_cpus(r),
            lambda h, r: _summary(h, list(r.teachers)))


def _rl_summary(history: list[dict], recipe) -> list[str]:
    ends = _first_and_last_eval(history, "eval/reward/total")
    if ends is None:
        return []
    a, b = ends
    return [f"held-out reward, step {a['step']} → step {b['step']}: {a['eval/reward/total']:.3f} → "
            f"{b['eval/reward/total']:.3f}; pass rate {a['eval/pass_rate']:.2f} → {b['eval/pass_rate']:.2f}"]


def _rl_plan():
    from k3post.dist.launch_rl import build_rl_in_process, build_rl_on_ray, rl_cpus_needed  # noqa: PLC0415
    from k3post.loops.rl import run_rl  # noqa: PLC0415

    return build_rl_in_process, build_rl_on_ray, run_rl, rl_cpus_needed, _rl_summary


def _sft_plan():
    from k3post.dist.launch_sft import build_sft_in_process, build_sft_on_ray  # noqa: PLC0415
    from k3post.loops.sft import run_sft  # noqa: PLC0415

    return build_sft_in_process, build_sft_on_ray, run_sft, lambda r: r.resources.learner.num_cpus, _sft_summary


# recipe kind -> (in-process builder, Ray builder, loop, CPUs needed, summary lines)
PLANS = {"distill": _distill_plan, "sft": _sft_plan, "rl": _rl_plan}


def run_recipe(recipe_path: Path, overrides: list[str], run_dir: Path | None, in_process: bool,
               restart: bool) -> int:
    recipe = load_run_recipe(recipe_path, overrides)
    return run_loaded_recipe(recipe, str(recipe_path), run_dir or Path("runs") / recipe_path.stem, in_process,
                             restart)


def run_loaded_recipe(recipe, label: str, run_dir: Path, in_process: bool, restart: bool) -> int:
    """Train a loaded sft / distill / rl recipe into `run_dir` (resuming what is there)."""
    started = time.time()
    prepare_run_dir(recipe, run_dir, restart)
    print(f"k3post: {label} → {run_dir}")
    build_local, build_ray, loop, cpus_needed, summary = PLANS[recipe.kind]()
    if in_process or recipe.ray.in_process:
        print("k3post: engines in this process (no Ray)")
        history = loop(build_local(recipe, run_dir))
    else:
        from k3post.dist.cluster import connect, disconnect  # noqa: PLC0415

        print("k3post: " + connect(recipe.ray, cpus_needed(recipe)))
        try:
            history = loop(build_ray(recipe, run_dir))
        finally:
            disconnect()
    for line in summary(history, recipe):
        print(line)
    print(f"k3post: done in {time.time() - started:.0f}s; metrics in {run_dir / 'metrics.jsonl'}, "
          f"TensorBoard in {run_dir / 'tensorboard'}, checkpoints in {run_dir / 'checkpoints'}")
    return 0
