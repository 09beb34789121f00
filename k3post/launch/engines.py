"""From a recipe to engine specs: the pieces every builder shares.

Preflight checks run in the driver before any engine starts; `learner_config` is the one place a
recipe becomes a `LearnerConfig`; the sampler and teacher specs name the engine class a recipe
asks for (HF or vLLM) and the group's resources; `cpus_needed` sizes a local Ray cluster.
"""

from __future__ import annotations

from k3post.algo.objectives import Objective
from k3post.config.placement_schema import group_keys, plan_bundles
from k3post.config.rl_schema import RlRecipe
from k3post.config.schema import DistillRecipe, ModelSpec, ResourcesSpec, SamplingSpec, TeacherSpec
from k3post.config.sft_schema import SftRecipe
from k3post.data.mixture import PromptSource
from k3post.data.prompt_length import within_limit
from k3post.engine.common import engine_device
from k3post.engine.teachers.cross_teacher import CrossTokenizerTeacher
from k3post.engine.samplers.fast_sampler import FastHFSampler
from k3post.engine.learner.learner import LearnerConfig
from k3post.engine.samplers.sampler import HFSampler
from k3post.engine.teachers.teacher import TeacherScorer
from k3post.launch.backend import EngineSpec

# How often a sampler, teacher or reward-model actor may die and be restarted (and a call be
# retried) before the run gives up; re-running the command then resumes from the last checkpoint.
ACTOR_RESTARTS = 2


def learner_config(recipe: DistillRecipe | RlRecipe | SftRecipe, objective: Objective, **by_kind) -> LearnerConfig:
    """The learner of a recipe of any kind; `by_kind`: the fields only some kinds have (the
    reference, the sampling temperature, MoE options, SFT's reply length)."""
    res = recipe.resources.learner
    sampling = getattr(recipe, "sampling", None)  # SFT samples nothing
    return LearnerConfig(student=recipe.student, optim=recipe.optim, objective=objective, total_steps=recipe.train.steps,
                         seed=recipe.train.seed, num_threads=res.threads, lora=recipe.lora, qat=recipe.qat,
                         compile=recipe.train.compile, device=engine_device(res), draft=recipe.draft,
                         on_policy=sampling.on_policy if sampling is not None else "off", **by_kind)


def sampler_restarts(sampling: SamplingSpec, resources: ResourcesSpec) -> int:
    """A restarted sampler is re-synced from the last weights in the object store; the other
    transports cannot reach a new process. So samplers are restarted only when the weights go
    through the object store (or auto resolves to it: without GPUs). Decided before the actors
    exist, so before auto is resolved."""
    on_gpus = resources.learner.num_gpus > 0 and resources.samplers.num_gpus > 0
    store = sampling.weight_transport == "object_store" or (sampling.weight_transport == "auto" and not on_gpus)
    return ACTOR_RESTARTS if store else 0


def sampler_spec(recipe: DistillRecipe | RlRecipe) -> EngineSpec:
    """The student's rollout engine (`sampling.engine`, `sampling.cache`) and its group."""
    res = recipe.resources
    restarts = sampler_restarts(recipe.sampling, res)
    if recipe.sampling.engine == "vllm":
        from k3post.engine.samplers.vllm_sampler import VLLMSampler  # noqa: PLC0415  (vLLM is optional)

        return EngineSpec(VLLMSampler, (recipe.student, recipe.sampling.vllm), res.samplers, restarts,
                          {"seed": recipe.train.seed, "system_prompt": recipe.sampling.system_prompt,
                           "num_gpus": res.samplers.num_gpus})
    options = {"device": engine_device(res.samplers), "system_prompt": recipe.sampling.system_prompt,
               "fp8_from_version": recipe.qat.fake_quant_after_n_steps if recipe.sampling.weights == "fp8" else None}
    if recipe.sampling.on_policy != "off":  # config/on_policy.py: engine hf
        options["on_policy"] = recipe.sampling.on_policy
    if recipe.draft.speculate is not None:  # config/draft_schema.py: engine hf (either cache)
        options |= {"speculate": recipe.draft.speculate, "draft_seed": recipe.train.seed,
                    "draft_hidden": recipe.draft.hidden}
    if recipe.sampling.cache == "static":
        return EngineSpec(FastHFSampler, (recipe.student,), res.samplers, restarts,
                          {**options, "compile": recipe.sampling.compile})
    return EngineSpec(HFSampler, (recipe.student,), res.samplers, restarts, options)


def teacher_spec(name: str, spec: TeacherSpec, own_prompt: dict | None = None,
                 cross_student: tuple[ModelSpec, str | None] | None = None) -> EngineSpec:
    """One teacher's scoring engine (`engine` in its YAML) and its group. Scoring is a pure
    function of its inputs, so a dead replica is restarted and its call retried. `own_prompt`:
    for a teacher whose chat template differs from the student's, the student's template and
    system prompt (it renders every prompt itself; launch/compat_checks.py). `cross_student`: for
    a teacher with another tokenizer, the student's model and system prompt (it reads the text:
    engine/teachers/cross_teacher.py, around the engine of its YAML)."""
    if cross_student is not None:
        return EngineSpec(CrossTokenizerTeacher, (name, spec, *cross_student), spec.resources, ACTOR_RESTARTS)
    cls = TeacherScorer
    if spec.engine == "vllm":
        from k3post.engine.teachers.vllm_teacher import VLLMTeacher  # noqa: PLC0415  (vLLM is optional)

        cls = VLLMTeacher
    return EngineSpec(cls, (name, spec), spec.resources, ACTOR_RESTARTS, dict(own_prompt or {}))


def cpus_needed(recipe: DistillRecipe | RlRecipe | SftRecipe) -> float:
    """CPU slots for every actor of the recipe (a local cluster is started with at least these)."""
    res = recipe.resources
    if getattr(res, "placement", None) is not None:  # the run's placement group: its bundles (none empty)
        return sum(bundle["CPU"] for bundle in plan_bundles(group_keys(recipe), res.placement).bundles)
    groups = [res.learner, *([res.samplers] if hasattr(res, "samplers") else [])]
    groups += [t.resources for t in getattr(recipe, "teachers", {}).values()]
    groups += [m.resources for m in getattr(recipe, "reward_models", {}).values()]
    return sum(g.replicas * g.num_cpus for g in groups)


def prompt_source(name: str, rows: list[dict], path: str, tokenizer, recipe, teacher: str = "", weight: float = 1.0,
                  heldout: int = 16, sft: bool = False) -> PromptSource:
    """One source of a run's mixture: its rows under the recipe's prompt-length policy
    (`data.max_prompt_tokens`, `data.long_prompts`), with what the policy changed."""
    rows, lengths = within_limit(rows, tokenizer, recipe.data, path, sft)
    return PromptSource(name, rows, teacher, weight, heldout, lengths)
