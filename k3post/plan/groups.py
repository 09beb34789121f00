"""A recipe's actor groups and what one actor of each needs: the recipe read as the run reads it.

The group keys and their resources come from config/placement_schema.py's `group_keys` (the
list the Ray backend places); which learner a rank runs and in what precision from
engine/sharded/learner_rank.py's `uses_sharding` and model/training/fsdp.py's `resolve_precision`; a vLLM
engine's reservation from config/vllm_resources.py. Only the byte counts are the planner's own
(k3post/plan/memory.py, serving.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from k3post.config.loss_schema import resolve_teacher_loss
from k3post.config.vllm_resources import engine_memory_utilization
from k3post.engine.sharded.learner_rank import uses_sharding
from k3post.model.training.fsdp import resolve_precision
from k3post.plan.memory import GIB, Breakdown, LearnerSetup, activation_bytes, learner_peak
from k3post.plan.serving import ServeSetup, sampler_peak, scorer_peak, vllm_peak
from k3post.plan.shapes import ModelShape, model_shape


@dataclass
class GroupNeed:
    """One actor group: `replicas` actors of `num_gpus` each, each needing `need` bytes (on its
    GPU share, or in host memory for a CPU actor); `notes` say how it was read."""

    key: str
    replicas: int
    num_gpus: float
    need: Breakdown
    notes: list[str] = field(default_factory=list)
    vllm_fraction: float = 0.0  # a vLLM engine's reservation, as a fraction of one GPU
    sleeps: bool = False  # vllm.sleep: on its device only while awake (engine/vllm/sleep.py)
    kv_tokens: float | None = None
    setup: Any = None  # the LearnerSetup of the learner group
    shape: ModelShape | None = None


@dataclass(frozen=True)
class Lengths:
    """The step's sizes as the planner reads them."""

    rows: int  # sequences per step (prompts × samples per prompt)
    prompt: int
    new_tokens: int


def step_lengths(recipe: Any, prompt_tokens: int | None) -> Lengths:
    """Rows and lengths of one step; prompts at `prompt_tokens` (default: data.max_prompt_tokens,
    the longest a recipe admits)."""
    prompt = prompt_tokens or recipe.data.max_prompt_tokens
    if recipe.kind == "sft":
        return Lengths(recipe.data.examples_per_step, prompt, recipe.data.max_completion_tokens)
    return Lengths(recipe.data.prompts_per_step * recipe.sampling.n, prompt, recipe.sampling.max_new_tokens)


def _device(num_gpus: float) -> str:
    return "cuda" if num_gpus > 0 else "cpu"


def _dtype_bytes(spec: Any, device: str) -> int:
    return 2 if spec.dtype == "bfloat16" else 4


def full_vocab_loss(recipe: Any) -> bool:
    if recipe.kind != "distill":
        return False
    return any(resolve_teacher_loss(t.loss, recipe.loss.kind, recipe.loss.kl_coef).kind == "full_vocab"
               for t in recipe.teachers.values())


def learner_setup(recipe: Any, lengths: Lengths, **changes: Any) -> LearnerSetup:
    """The learner rank's setup the recipe gives (engine/sharded/learner_rank.py decides the learner)."""
    res, spec = recipe.resources.learner, recipe.learner
    device = _device(res.num_gpus)
    ranks = changes.pop("ranks", res.replicas)
    rows_per_rank = math.ceil(lengths.rows / ranks)
    reference = getattr(getattr(getattr(recipe, "loss", None), "reference", None), "kind", "none")
    setup = dict(
        precision=resolve_precision(spec.precision, device, recipe.student.dtype),
        sharded=uses_sharding(spec, ranks, device, recipe.student.dtype), ranks=ranks,
        micro_batch=min(recipe.optim.micro_batch_size, rows_per_rank), seq_len=lengths.prompt + lengths.new_tokens,
        completion_len=lengths.new_tokens, shard_unit=spec.shard_unit,
        activation_checkpointing=spec.activation_checkpointing, compiled=recipe.train.compile and device == "cuda",
        reference=reference, qat=recipe.qat.enabled, lora_rank=recipe.lora.rank, full_vocab=full_vocab_loss(recipe),
        rows_per_step=rows_per_rank, draft=getattr(getattr(recipe, "draft", None), "kind", "none") == "mtp",
        samplers_copy=_dtype_bytes(recipe.student, device) if recipe.kind != "sft" and device == "cuda" else 0)
    setup.update(changes)
    return LearnerSetup(**setup)


def checkpointing_both_ways(shape: ModelShape, setup: LearnerSetup) -> str:
    """The learner's activations and peak with activation checkpointing off and on, side by side."""
    def line(ac: bool) -> str:
        other = replace(setup, activation_checkpointing=ac)
        return (f"{'on' if ac else 'off'}: activations {activation_bytes(shape, other) / GIB:.1f}, "
                f"peak {learner_peak(shape, other).total / GIB:.1f}")
    return f"activation checkpointing {line(False)}; {line(True)} (GiB)"


def learner_need(recipe: Any, shape: ModelShape, lengths: Lengths) -> GroupNeed:
    setup = learner_setup(recipe, lengths)
    res = recipe.resources.learner
    kind = f"FSDP2 over {setup.ranks}, unit {setup.shard_unit}" if setup.sharded else "one unsharded rank"
    notes = [f"{shape.params / 1e9:.2f}B params, {setup.precision}, {kind}, micro-batch {setup.micro_batch} × "
             f"{setup.seq_len} tokens, AC {'on' if setup.activation_checkpointing else 'off'}, reference "
             f"{setup.reference}", checkpointing_both_ways(shape, setup)]
    if setup.sharded and setup.lora_rank:  # engine/sharded/sharded_learner.py: check_shardable refuses it at start
        notes.append("the run would stop at start: LoRA needs one unsharded rank (learner.precision: bf16 or fp32 "
                     "with one replica)")
    if setup.sharded and getattr(getattr(recipe, "moe", None), "bias_update", "none") != "none":
        notes.append("the run would stop at start: moe.bias_update needs one unsharded rank")
    return GroupNeed("learner", res.replicas, res.num_gpus, learner_peak(shape, setup), notes, setup=setup,
                     shape=shape)


def _serving_need(key: str, shape: ModelShape, res: Any, engine: tuple[str, Any], setup: ServeSetup, scorer: bool,
                  gpu_bytes: float) -> GroupNeed:
    """One serving actor's need; `engine`: (hf | vllm, its VllmSpec)."""
    kind, vllm = engine
    if kind == "vllm" and res.num_gpus > 0:
        fraction = engine_memory_utilization(vllm.gpu_memory_utilization, res.num_gpus)
        gpus = max(1, int(res.num_gpus)) if res.num_gpus >= 1 else 1
        reserved = fraction * gpu_bytes * gpus
        need, kv_tokens = vllm_peak(shape, setup, reserved)
        note = (f"vLLM reserves {fraction:.2f} of {'each of ' + str(gpus) + ' GPUs' if gpus > 1 else 'its GPU'}; "
                f"KV cache left for {max(kv_tokens, 0):,.0f} tokens (the step needs "
                f"{setup.rows * (setup.prompt_len + setup.new_tokens):,})")
        if vllm.sleep:  # asleep, its weights wait in pinned host memory (engine/vllm/sleep.py)
            need.host_pinned = shape.params * setup.dtype_bytes
            note += ("; asleep between its turns (vllm.sleep): its reservation counts only while it is awake, and "
                     "the sleeping engines of a device take turns; its weights wait in pinned host memory "
                     + ("from its first sleep on (a teacher keeps that copy)" if scorer else "while it sleeps"))
        return GroupNeed(key, res.replicas, res.num_gpus, need, [note], vllm_fraction=fraction, kv_tokens=kv_tokens,
                         shape=shape, sleeps=vllm.sleep)
    need = scorer_peak(shape, setup) if scorer else sampler_peak(shape, setup)
    return GroupNeed(key, res.replicas, res.num_gpus, need,
                     [f"{shape.params / 1e9:.2f}B params, HF engine, {setup.rows} rows × "
                      f"{setup.prompt_len} + {setup.new_tokens} tokens per actor"], shape=shape)


def teacher_rows(recipe: Any, name: str, rows: int) -> int:
    """The step's rows routed to teacher `name`, by the sources' weights."""
    sources = recipe.data.sources
    total = sum(s.weight for s in sources)
    return math.ceil(rows * sum(s.weight for s in sources if s.teacher == name) / total)


def group_needs(recipe: Any, lengths: Lengths, gpu_bytes: float,
                shapes: dict[str, ModelShape] | None = None) -> list[GroupNeed]:
    """Every actor group of the recipe, in the order config/placement_schema.py lists them."""
    shapes = shapes if shapes is not None else {}
    student = shapes.get("student") or model_shape(recipe.student)
    needs = [learner_need(recipe, student, lengths)]
    if hasattr(recipe.resources, "samplers"):
        res, sampling = recipe.resources.samplers, recipe.sampling
        sync = (recipe.learner.weight_bucket_mb * 2**20 if sampling.weight_transport in ("auto", "collective")
                and res.num_gpus > 0 and res.num_gpus + recipe.resources.learner.num_gpus >= 2 else 0.0)
        setup = ServeSetup(_dtype_bytes(recipe.student, _device(res.num_gpus)), math.ceil(lengths.rows / res.replicas),
                           lengths.prompt, lengths.new_tokens, sync)
        needs.append(_serving_need("samplers", student, res, (sampling.engine, sampling.vllm), setup, False, gpu_bytes))
    for name, teacher in getattr(recipe, "teachers", {}).items():
        shape = shapes.get(f"teacher/{name}") or model_shape(teacher.model)
        rows = math.ceil(teacher_rows(recipe, name, lengths.rows) / teacher.resources.replicas)
        loss = resolve_teacher_loss(teacher.loss, recipe.loss.kind, recipe.loss.kl_coef)
        sends = loss.kind == "full_vocab" and loss.send == "logprobs"
        setup = ServeSetup(_dtype_bytes(teacher.model, ""), rows, lengths.prompt, lengths.new_tokens, 0.0, sends)
        needs.append(_serving_need(f"teacher/{name}", shape, teacher.resources, (teacher.engine, teacher.vllm),
                                   setup, True, gpu_bytes))
    for name, model in getattr(recipe, "reward_models", {}).items():
        shape = shapes.get(f"reward_model/{name}") or _reward_shape(model)
        setup = ServeSetup(4, model.batch_size, min(lengths.prompt + lengths.new_tokens, model.max_length), 0)
        needs.append(_serving_need(f"reward_model/{name}", shape, model.resources, ("hf", None), setup, True,
                                   gpu_bytes))
    return needs


def _reward_shape(model: Any) -> ModelShape:
    """A reward model's body counted as its causal-LM config (the one-logit score head is tiny)."""
    from k3post.config.schema import ModelSpec  # noqa: PLC0415

    spec = ModelSpec(path=model.path) if model.path is not None else ModelSpec(tiny=model.tiny)
    return model_shape(spec)
