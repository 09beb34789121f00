"""Building an RL run (`kind: rl`): data and reward functions first (both fail before any model
loads), then the learner, the samplers and the reward models over a backend, the weight-sync
strategy and the loop's `RlRun`."""

from __future__ import annotations

from pathlib import Path

from k3post.algo.objectives import RlPolicyLoss
from k3post.config.rl_schema import RlRecipe
from k3post.data.mixture import PromptMixture
from k3post.data.sources import load_source_rows
from k3post.launch.backend import Backend
from k3post.launch.compat_checks import check_chat_template, check_vllm_lengths
from k3post.launch.engines import learner_config, prompt_source, sampler_spec
from k3post.launch.rewards import reward_scorer
from k3post.loops.rl import RlRun
from k3post.model.loading.load import load_tokenizer
from k3post.track.run_dir import RESOLVED


def with_suffix(rows: list[dict], suffix: str) -> list[dict]:
    """Append `suffix` to each row's last user turn (a per-source instruction)."""
    if not suffix:
        return rows
    out = []
    for row in rows:
        turns = list(row["messages"])
        users = [i for i, (role, _) in enumerate(turns) if role == "user"]
        last = users[-1] if users else len(turns) - 1
        turns[last] = (turns[last][0], turns[last][1] + suffix)
        out.append({**row, "messages": turns})
    return out


def build_rl_data(recipe: RlRecipe, tokenizer) -> PromptMixture:
    """The prompt mixture; `tokenizer` (the student's) counts prompt tokens for data.long_prompts."""
    sources = [prompt_source(s.name, with_suffix(load_source_rows(s.prompts, s.heldout_prompts, Path.cwd()),
                                                 s.prompt_suffix),
                             s.prompts, tokenizer, recipe, weight=s.weight, heldout=s.heldout) for s in recipe.data.sources]
    return PromptMixture(sources, recipe.train.seed)


def build_rl_run(recipe: RlRecipe, run_dir: Path, backend: Backend) -> RlRun:
    tokenizer = load_tokenizer(recipe.student)  # loaded once: data lengths and the pad id
    check_chat_template(tokenizer, run_dir / RESOLVED, "student", "student")
    data = build_rl_data(recipe, tokenizer)
    check_vllm_lengths(recipe, data, tokenizer, run_dir / RESOLVED)
    loss = recipe.loss
    objective = RlPolicyLoss(loss.policy_loss, loss.clip_low, loss.clip_high, loss.dual_clip)
    rewards = reward_scorer(recipe, data, backend)  # a bad reward name fails before any model loads
    config = learner_config(recipe, objective, reference=loss.reference,
                            sampling_temperature=recipe.sampling.temperature,
                            fp8_weights=recipe.sampling.weights == "fp8")
    learner = backend.learner(config, recipe.learner, recipe.resources.learner)
    samplers = backend.samplers(sampler_spec(recipe), tokenizer.pad_token_id)
    backend.start(f"learner, samplers on {recipe.sampling.engine}, reward models: "
                  + (", ".join(recipe.reward_models) or "none"))
    weight_sync = backend.weight_sync(recipe.sampling, recipe.resources, learner, samplers)
    return RlRun(recipe, run_dir, samplers, learner, weight_sync, data, rewards)
