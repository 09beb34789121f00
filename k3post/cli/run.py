"""`k3post run`: load the recipe, prepare the run directory, start the engines, run the loop."""

from __future__ import annotations

import time
from pathlib import Path

from k3post.config.load import load_run_recipe
from k3post.track.run_dir import check_run_dir, prepare_run_dir


def run_recipe(recipe_path: Path, overrides: list[str], run_dir: Path | None, in_process: bool,
               restart: bool) -> int:
    recipe = load_run_recipe(recipe_path, overrides)
    return run_loaded_recipe(recipe, str(recipe_path), run_dir or Path("runs") / recipe_path.stem, in_process,
                             restart)


def run_loaded_recipe(recipe, label: str, run_dir: Path, in_process: bool, restart: bool) -> int:
    """Train a loaded sft / distill / rl recipe into `run_dir` (resuming what is there): prepare
    the run directory, pick the backend, build, loop, summarise."""
    from k3post.launch.plans import PLANS  # noqa: PLC0415  (torch and transformers: after the recipe loaded)

    from k3post.cli.inputs import check_inputs  # noqa: PLC0415

    started = time.time()
    check_run_dir(run_dir, restart)  # the run directory, the models' headers and every data row are
    check_inputs(recipe, label)  # checked before Ray starts and before the first write into the run directory
    prepare_run_dir(recipe, run_dir, restart)
    print(f"k3post: {label} → {run_dir}")
    plan = PLANS[recipe.kind]
    if in_process or recipe.ray.in_process:
        from k3post.launch.in_process import InProcessBackend  # noqa: PLC0415

        print("k3post: engines in this process (no Ray)")
        history = plan.loop(plan.build(recipe, run_dir, InProcessBackend()))
    else:
        from k3post.ray.backend import ray_backend  # noqa: PLC0415

        with ray_backend(recipe) as backend:
            history = plan.loop(plan.build(recipe, run_dir, backend))
    for line in plan.summary(history, recipe):
        print(line)
    print(f"k3post: done in {time.time() - started:.0f}s; metrics in {run_dir / 'metrics.jsonl'}, "
          f"TensorBoard in {run_dir / 'tensorboard'}, checkpoints in {run_dir / 'checkpoints'}")
    return 0
