"""Launching an SFT recipe: one learner, in this process or as a Ray actor."""

from __future__ import annotations

from pathlib import Path

from k3post.config.schema import SftRecipe
from k3post.data.mixture import PromptMixture, SourceSpec
from k3post.data.sft import as_sft_rows
from k3post.data.sources import load_prompt_rows
from k3post.engine.learner import Learner, LearnerConfig
from k3post.loops.sft import SftRun


def build_sft_data(recipe: SftRecipe) -> PromptMixture:
    sources = []
    for s in recipe.data.sources:
        rows = as_sft_rows(load_prompt_rows(s.examples, Path.cwd()), s.completion_field, s.examples)
        sources.append(SourceSpec(s.name, rows, teacher="", weight=s.weight, heldout=s.heldout))
    return PromptMixture(sources, recipe.train.seed)


def sft_learner_config(recipe: SftRecipe, threads: int | None = None) -> LearnerConfig:
    from k3post.config.schema import LossSpec  # noqa: PLC0415

    return LearnerConfig(recipe.model, recipe.optim, LossSpec(), recipe.train.steps, 1.0, recipe.train.seed, threads,
                         recipe.lora, recipe.qat, objective="sft",
                         max_completion_tokens=recipe.data.max_completion_tokens, compile=recipe.train.compile)


def build_sft_in_process(recipe: SftRecipe, run_dir: Path) -> SftRun:
    data = build_sft_data(recipe)  # before loading the model: bad data fails fast
    return SftRun(recipe, run_dir, Learner(sft_learner_config(recipe)), data)


def build_sft_on_ray(recipe: SftRecipe, run_dir: Path) -> SftRun:
    import ray  # noqa: PLC0415

    from k3post.dist.ray_groups import RayLearner  # noqa: PLC0415

    data = build_sft_data(recipe)
    res = recipe.resources.learner
    actor = ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus)(Learner).remote(
        sft_learner_config(recipe, res.threads))
    return SftRun(recipe, run_dir, RayLearner(actor), data)
