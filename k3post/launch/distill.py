"""Building an on-policy distillation run: data first (bad data fails before any model loads),
preflight checks, then the learner, the samplers, one group per teacher and any reward models
over a backend, then the weight-sync strategy and the loop's `DistillRun`."""

from __future__ import annotations

from pathlib import Path

from k3post.algo.objectives import PerTeacherOPD, per_teacher_objective
from k3post.config.errors import UserError
from k3post.config.loss_schema import TeacherLossSpec, resolve_teacher_loss
from k3post.config.schema import DistillRecipe
from k3post.data.mixture import PromptMixture
from k3post.data.sources import load_source_rows
from k3post.launch.backend import Backend, EngineSpec
from k3post.launch.compat_checks import check_distill_compat, check_vllm_lengths, teacher_tokenizers
from k3post.launch.engines import learner_config, prompt_source, sampler_spec, teacher_spec
from k3post.launch.rewards import reward_scorer
from k3post.loops.distill import DistillRun
from k3post.model.loading.load import load_tokenizer
from k3post.model.tokenizers.token_text import describe
from k3post.track.run_dir import RESOLVED


def build_data(recipe: DistillRecipe, tokenizer) -> PromptMixture:
    """The prompt mixture; `tokenizer` (the student's) counts prompt tokens for data.long_prompts."""
    sources = [prompt_source(s.name, load_source_rows(s.prompts, s.heldout_prompts, Path.cwd()), s.prompts, tokenizer,
                             recipe, s.teacher, s.weight, s.heldout) for s in recipe.data.sources]
    return PromptMixture(sources, recipe.train.seed)


def teacher_losses(recipe: DistillRecipe) -> dict[str, TeacherLossSpec]:
    """Each teacher's loss: its YAML's `loss:`, or the recipe's loss.kind and kl_coef."""
    return {name: resolve_teacher_loss(spec.loss, recipe.loss.kind, recipe.loss.kl_coef)
            for name, spec in recipe.teachers.items()}


def check_rewards_with_losses(recipe: DistillRecipe, losses: dict[str, TeacherLossSpec]) -> None:
    """Task rewards mix into sampled-token advantages: a source with rewards needs a teacher whose
    loss uses them (another loss would drop the rewards without a word)."""
    for source in recipe.data.sources:
        kind = losses[source.teacher].kind
        if source.rewards and kind != "sampled_token":
            raise UserError(f"data.sources[{source.name}].rewards: rewards mix into sampled-token advantages, but "
                            f"teacher '{source.teacher}' uses loss kind {kind}; give it `loss: {{kind: "
                            f"sampled_token}}` in its YAML or drop the rewards")


def note_full_vocab_on_vllm(recipe: DistillRecipe, losses: dict[str, TeacherLossSpec]) -> None:
    """A full_vocab teacher on vLLM gets its distributions from an HF copy on the CPU (vLLM returns
    top-k only; engine/teachers/vllm_teacher.py). On a CPU that is what an HF teacher does; beside a GPU it
    would make every step wait for a CPU forward of the teacher, so it is refused there."""
    for name, teacher in recipe.teachers.items():
        if teacher.engine != "vllm" or losses[name].kind != "full_vocab":
            continue
        if teacher.resources.num_gpus > 0:
            raise UserError(f"teacher '{name}': the full_vocab loss needs the teacher's whole next-token distribution "
                            f"(or hidden states) at every step, which vLLM does not return, and a second copy of the "
                            f"teacher beside vLLM on its GPU would run out of memory; use engine: hf for this teacher, "
                            f"or a topk_* loss (vLLM's prompt logprobs) in its YAML (docs/engines.md)")
        print(f"k3post: note: teacher '{name}' runs on vLLM, but the full_vocab loss needs its whole "
              f"next-token distributions, which vLLM does not return: they come from an HF copy of the "
              f"teacher on the CPU in the same actor (loss.kind=sampled_token scores through vLLM alone)")


def build_distill_run(recipe: DistillRecipe, run_dir: Path, backend: Backend) -> DistillRun:
    tokenizer = load_tokenizer(recipe.student)  # loaded once: data lengths, teacher checks, the pad id
    losses = teacher_losses(recipe)
    recipe_file = run_dir / RESOLVED  # where the keys the start-up checks name are, teachers inline
    teacher_tokens = teacher_tokenizers(recipe)  # once per distinct teacher model, for both checks
    routes = check_distill_compat(recipe, tokenizer, {n: loss.kind for n, loss in losses.items()}, recipe_file,
                                  teacher_tokens)
    say_cross_tokenizer(recipe, routes, losses, tokenizer, teacher_tokens)
    data = build_data(recipe, tokenizer)
    check_vllm_lengths(recipe, data, tokenizer, recipe_file, teacher_tokens)
    pad_id = tokenizer.pad_token_id
    check_rewards_with_losses(recipe, losses)
    note_full_vocab_on_vllm(recipe, losses)
    objective = per_teacher_objective(losses)
    config = learner_config(recipe, objective, reference=recipe.loss.reference,
                            sampling_temperature=recipe.sampling.temperature, moe=recipe.moe,
                            fp8_weights=recipe.sampling.weights == "fp8")
    learner = backend.learner(config, recipe.learner, recipe.resources.learner)
    samplers = backend.samplers(sampler_spec(recipe), pad_id)
    teachers = {name: backend.teacher(teacher_engine(recipe, name, routes[name], tokenizer))
                for name in recipe.teachers}
    rewards = reward_scorer(recipe, data, backend) if any(s.rewards for s in recipe.data.sources) else None
    backend.start(f"learner, samplers on {recipe.sampling.engine}, teachers: "
                  + ", ".join(f"{name} on {spec.engine}" for name, spec in recipe.teachers.items()))
    ship_teacher_heads(objective, teachers, learner)
    weight_sync = backend.weight_sync(recipe.sampling, recipe.resources, learner, samplers)
    cross = frozenset(name for name, route in routes.items() if route == "cross")
    return DistillRun(recipe, run_dir, samplers, teachers, learner, weight_sync, objective, data, rewards=rewards,
                      cross_tokenizer=cross)


def teacher_engine(recipe: DistillRecipe, name: str, route: str, tokenizer) -> EngineSpec:
    """The engine of one teacher by its route (launch/compat_checks.py: teacher_route)."""
    spec, system = recipe.teachers[name], recipe.sampling.system_prompt
    if route == "cross":
        return teacher_spec(name, spec, cross_student=(recipe.student, system))
    own = {"student_template": tokenizer.chat_template, "student_system_prompt": system}
    if route == "own_template":  # engine hf only (launch/compat_checks.py)
        return teacher_spec(name, spec, own)
    # Same template: the teacher scores the sampler's ids, rendered with the student's system
    # prompt, which the HF scorer needs only to know the rows' common head (engine/teachers/teacher_prefix.py);
    # vLLM keeps no prefix cache for prompt logprobs, so it is not told.
    return teacher_spec(name, spec, {"student_system_prompt": system} if spec.engine == "hf" else None)


def say_cross_tokenizer(recipe: DistillRecipe, routes: dict[str, str], losses: dict[str, TeacherLossSpec],
                        student_tokenizer, tokenizers: dict) -> None:
    """One line per teacher that reads the student's text through its own tokenizer (`losses`:
    each teacher's resolved loss, `teacher_losses`)."""
    for name, route in routes.items():
        if route == "cross":
            settings, loss = recipe.teachers[name].cross_tokenizer, losses[name]
            dense = "" if loss.kind == "sampled_token" else \
                f"{loss.kind} (k {loss.k}) on the {settings.dense_support} support of 1:1 chunks, elsewhere "
            print(f"k3post: teacher '{name}' reads the student's text with its own tokenizer (teacher: "
                  f"{describe(tokenizers[name])}; student: {describe(student_tokenizer)}): cross-tokenizer "
                  f"{dense}sampled-token OPD, split {settings.split}, chunks of at most {settings.max_chunk_tokens} "
                  f"tokens")


def ship_teacher_heads(objective: PerTeacherOPD, teachers: dict, learner) -> None:
    """The output head of every teacher that sends hidden states, teacher → learner once (on Ray by
    reference: the driver passes the ObjectRef on). Teachers are frozen: it never changes."""
    for name, term in objective.terms:
        if term.scoring[0] == "score_with_hidden":
            learner.set_teacher_head(name, teachers[name].output_head())
