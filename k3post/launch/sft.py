"""Building an SFT run: the examples first (bad data fails before the model loads), then the
learner group over a backend, and the loop's `SftRun`."""

from __future__ import annotations

from pathlib import Path

from k3post.algo.objectives import SftNll
from k3post.config.sft_schema import SftRecipe
from k3post.data.mixture import PromptMixture
from k3post.data.sft import as_sft_rows
from k3post.data.sources import load_prompt_rows
from k3post.launch.backend import Backend
from k3post.launch.engines import learner_config, prompt_source
from k3post.loops.sft import SftRun


def build_sft_data(recipe: SftRecipe) -> PromptMixture:
    from k3post.model.loading.load import load_tokenizer  # noqa: PLC0415

    tokenizer, sources = load_tokenizer(recipe.student), []  # the tokenizer counts prompt tokens (data.long_prompts)
    for s in recipe.data.sources:
        rows = as_sft_rows(load_prompt_rows(s.examples, Path.cwd()), s.completion_field, s.examples)
        sources.append(prompt_source(s.name, rows, s.examples, tokenizer, recipe, weight=s.weight, heldout=s.heldout,
                                     sft=True))
    return PromptMixture(sources, recipe.train.seed)


def build_sft_run(recipe: SftRecipe, run_dir: Path, backend: Backend) -> SftRun:
    data = build_sft_data(recipe)
    config = learner_config(recipe, SftNll(), max_completion_tokens=recipe.data.max_completion_tokens)
    learner = backend.learner(config, recipe.learner, recipe.resources.learner)
    backend.start("learner")
    return SftRun(recipe, run_dir, learner, data)
