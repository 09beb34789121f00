"""Building an on-policy distillation run: data first (bad data fails before any model loads),
preflight checks, then the learner, the samplers, one group per teacher and any reward models
over a backend, then the weight-sync strategy and the loop's `DistillRun`."""

from __future__ import annotations

from pathlib import Path

from k3post.algo.objectives import OPD_OBJECTIVES
from k3post.config.schema import DistillRecipe
from k3post.data.mixture import PromptMixture
from k3post.data.sources import load_source_rows
from k3post.launch.backend import Backend
from k3post.launch.engines import check_tokenizers, learner_config, prompt_source, sampler_spec, teacher_spec
from k3post.launch.rewards import reward_scorer
from k3post.loops.distill import DistillRun


def build_data(recipe: DistillRecipe) -> PromptMixture:
    from k3post.model.load import load_tokenizer  # noqa: PLC0415

    tokenizer = load_tokenizer(recipe.student)  # counts prompt tokens for data.long_prompts
    sources = [prompt_source(s.name, load_source_rows(s.prompts, s.heldout_prompts, Path.cwd()), s.prompts, tokenizer,
                             recipe, s.teacher, s.weight, s.heldout) for s in recipe.data.sources]
    return PromptMixture(sources, recipe.train.seed)


def note_full_vocab_on_vllm(recipe: DistillRecipe) -> None:
    if recipe.loss.kind != "full_vocab":
        return
    for name, teacher in recipe.teachers.items():
        if teacher.engine == "vllm":
            print(f"k3post: note: teacher '{name}' runs on vLLM, but the full_vocab loss needs its whole "
                  f"next-token distributions, which vLLM does not return: they come from an HF copy of the "
                  f"teacher in the same actor (loss.kind=sampled_token scores through vLLM alone)")


def build_distill_run(recipe: DistillRecipe, run_dir: Path, backend: Backend) -> DistillRun:
    data = build_data(recipe)
    pad_id = check_tokenizers(recipe)
    note_full_vocab_on_vllm(recipe)
    objective = OPD_OBJECTIVES[recipe.loss.kind]()
    config = learner_config(recipe, objective, reference=recipe.loss.reference,
                            sampling_temperature=recipe.sampling.temperature, moe=recipe.moe)
    learner = backend.learner(config, recipe.learner, recipe.resources.learner)
    samplers = backend.samplers(sampler_spec(recipe), pad_id)
    teachers = {name: backend.teacher(teacher_spec(name, spec)) for name, spec in recipe.teachers.items()}
    rewards = reward_scorer(recipe, data, backend) if any(s.rewards for s in recipe.data.sources) else None
    backend.start(f"learner, samplers on {recipe.sampling.engine}, teachers: "
                  + ", ".join(f"{name} on {spec.engine}" for name, spec in recipe.teachers.items()))
    weight_sync = backend.weight_sync(recipe.sampling, recipe.resources, learner, samplers)
    return DistillRun(recipe, run_dir, samplers, teachers, learner, weight_sync, objective, data, rewards=rewards)
