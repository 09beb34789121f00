"""Turning a recipe into a running set of engines: preflight checks, then actors (or
in-process engines), then the loop's `DistillRun`."""

from __future__ import annotations

import time
from pathlib import Path

from k3post.config.errors import UserError
from k3post.config.schema import DistillRecipe, ResourceSpec, RlRecipe, TeacherSpec
from k3post.data.mixture import PromptMixture, SourceSpec
from k3post.data.sources import load_prompt_rows
from k3post.engine.common import engine_device
from k3post.engine.fast_sampler import FastHFSampler
from k3post.engine.learner import Learner, LearnerConfig
from k3post.engine.sampler import HFSampler, vocab_fingerprint
from k3post.engine.teacher import TeacherScorer
from k3post.loops.distill import DistillRun
from k3post.model.load import load_tokenizer, model_directory


def build_data(recipe: DistillRecipe) -> PromptMixture:
    sources = [SourceSpec(s.name, load_prompt_rows(s.prompts, Path.cwd()), s.teacher, s.weight, s.heldout)
               for s in recipe.data.sources]
    return PromptMixture(sources, recipe.train.seed)


def learner_config(recipe: DistillRecipe, threads: int | None = None) -> LearnerConfig:
    return LearnerConfig(recipe.student, recipe.optim, recipe.loss, recipe.train.steps, recipe.sampling.temperature,
                         recipe.train.seed, threads, recipe.lora, recipe.qat, compile=recipe.train.compile,
                         device=engine_device(recipe.resources.learner), moe=recipe.moe)


def preflight(recipe: DistillRecipe) -> int:
    """Fail early, in the driver, with clear messages: every model resolvable (GGUFs converted
    once here, not in racing actors) and every teacher sharing the student's tokenizer."""
    student_vocab = vocab_fingerprint(load_tokenizer(recipe.student))
    for name, teacher in recipe.teachers.items():
        model_directory(teacher.model)
        vocab = vocab_fingerprint(load_tokenizer(teacher.model))
        if vocab != student_vocab:
            what = "vocabulary size" if vocab[0] != student_vocab[0] else "chat template"
            raise UserError(
                f"teacher '{name}' does not share the student's tokenizer ({what} differs: teacher "
                f"{vocab[0]} tokens, student {student_vocab[0]}). On-policy distillation scores the student's "
                f"token ids with the teacher, so both must use the same tokenizer and chat template."
            )
    if recipe.loss.kind == "full_vocab":
        for name, teacher in recipe.teachers.items():
            if teacher.engine == "vllm":
                print(f"k3post: note: teacher '{name}' runs on vLLM, but the full_vocab loss needs its whole "
                      f"next-token distributions, which vLLM does not return: they come from an HF copy of the "
                      f"teacher in the same actor (loss.kind=sampled_token scores through vLLM alone)")
    return load_tokenizer(recipe.student).pad_token_id


def sampler_engine(recipe: DistillRecipe, threads: int | None = None) -> tuple[type, tuple]:
    """The student's rollout engine class and its constructor arguments (`sampling.engine`)."""
    if recipe.sampling.engine == "vllm":
        from k3post.engine.vllm_sampler import VLLMSampler  # noqa: PLC0415  (vLLM is optional)

        return VLLMSampler, (recipe.student, recipe.sampling.vllm, threads, recipe.train.seed)
    device = engine_device(recipe.resources.samplers)
    if recipe.sampling.cache == "static":
        return FastHFSampler, (recipe.student, threads, device, recipe.sampling.compile)
    return HFSampler, (recipe.student, threads, device)


def teacher_engine(spec: TeacherSpec) -> type:
    """The scoring engine class of one teacher (`engine` in its YAML)."""
    if spec.engine == "vllm":
        from k3post.engine.vllm_teacher import VLLMTeacher  # noqa: PLC0415  (vLLM is optional)

        return VLLMTeacher
    return TeacherScorer


def build_in_process(recipe: DistillRecipe, run_dir: Path) -> DistillRun:
    from k3post.dist.local import LocalSamplers, LocalTeacher  # noqa: PLC0415

    preflight(recipe)
    learner = Learner(learner_config(recipe))
    sampler_cls, sampler_args = sampler_engine(recipe)
    samplers = LocalSamplers(sampler_cls(*sampler_args))
    teachers = {name: LocalTeacher(teacher_engine(spec)(name, spec)) for name, spec in recipe.teachers.items()}
    return DistillRun(recipe, run_dir, samplers, teachers, learner, build_data(recipe))


# How often a sampler or teacher actor may die and be restarted (and a call be retried) before
# the run gives up; re-running the command then resumes from the last checkpoint.
ACTOR_RESTARTS = 2


def cpus_needed(recipe: DistillRecipe) -> float:
    groups = [recipe.resources.samplers, recipe.resources.learner] + [t.resources for t in recipe.teachers.values()]
    return sum(g.replicas * g.num_cpus for g in groups)


def remote(cls: type, res: ResourceSpec, restarts: int):
    """`cls` as a Ray actor class with the group's resources (engines are plain classes; they
    become actors only here). `restarts`: how often Ray restarts a dead actor and retries its call."""
    import ray  # noqa: PLC0415

    return ray.remote(num_cpus=res.num_cpus, num_gpus=res.num_gpus, max_restarts=restarts,
                      max_task_retries=restarts)(cls)


def sampler_actors(recipe: DistillRecipe | RlRecipe) -> list:
    """The sampler replicas as actors. They are restarted (the constructor reloads the model) and
    their calls retried, since a sampler call re-syncs a restarted replica's weights before it
    samples (ray_groups.RaySamplers) - with weights from the object store; the GPU-to-GPU
    transports cannot re-sync a new process (weight_groups.sampler_restarts)."""
    from k3post.dist.weight_groups import sampler_restarts  # noqa: PLC0415

    res = recipe.resources
    sampler_cls, sampler_args = sampler_engine(recipe, res.samplers.threads)
    restarts = sampler_restarts(recipe.sampling, res, ACTOR_RESTARTS)
    return [remote(sampler_cls, res.samplers, restarts).remote(*sampler_args) for _ in range(res.samplers.replicas)]


def build_on_ray(recipe: DistillRecipe, run_dir: Path) -> DistillRun:
    import ray  # noqa: PLC0415

    from k3post.dist.ray_groups import RayLearner, RaySamplers, RayTeacher  # noqa: PLC0415
    from k3post.dist.weight_groups import connect_weights  # noqa: PLC0415

    pad_id = preflight(recipe)
    res = recipe.resources
    # The learner's weights and optimizer live only in it: a restarted learner would silently go
    # on from the initial weights, so it is not restarted; its death ends the run, and re-running
    # resumes from the last checkpoint.
    learner = remote(Learner, res.learner, 0).remote(learner_config(recipe, res.learner.threads))
    samplers = sampler_actors(recipe)
    # Teachers are restarted and their calls retried: scoring is a pure function of its inputs.
    teachers = {
        name: RayTeacher([remote(teacher_engine(spec), spec.resources, ACTOR_RESTARTS).remote(name, spec,
                                                                                             spec.resources.threads)
                          for _ in range(spec.resources.replicas)])
        for name, spec in recipe.teachers.items()
    }
    actors = [learner, *samplers, *(a for group in teachers.values() for a in group.actors)]
    started = time.perf_counter()
    ray.get([actor.__ray_ready__.remote() for actor in actors])  # constructors done: models loaded
    print(f"k3post: {len(actors)} actors ready in {time.perf_counter() - started:.0f}s "
          f"(learner, {len(samplers)} sampler(s) on {recipe.sampling.engine}, teachers: "
          f"{', '.join(f'{name} on {spec.engine}' for name, spec in recipe.teachers.items())})")
    transport = connect_weights(recipe.sampling, res, learner, samplers)
    return DistillRun(recipe, run_dir, RaySamplers(samplers, pad_id), teachers, RayLearner(learner, transport),
                      build_data(recipe))
