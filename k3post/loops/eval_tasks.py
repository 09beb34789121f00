"""One function per task kind: (context, model entry, model, prepared task) → result records.

Each record is one number of the report: {model, task, kind, metric, value, ci_low, ci_high,
ci_method, confidence, n, seed, ...}; `n` is the number of units the interval is over (prompts
for rates, sequences for KL/NLL). The maths lives in algo/eval_metrics.py; here we only sample,
score and count. Tasks are chosen from `TASK_RUNNERS`, a name → function table.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from k3post.algo.cross_tokenizer import aligned_logratios
from k3post.algo.eval_metrics import Estimate, bootstrap_ratio, mean_pass_at_k, rate_estimate, sequence_kl
from k3post.algo.eval_metrics import sequence_nll
from k3post.algo.text_metrics import behaviour_score, ngram_counts
from k3post.config.errors import UserError
from k3post.config.eval_schema import EvalRecipe
from k3post.loops.eval_plan import ModelEntry
from k3post.rewards.pool import RewardPool
from k3post.types import Prompt, Rollouts, SamplingParams

SAMPLES_KEPT = 8  # completions per (model, task) written to samples.jsonl


class EvalModel(Protocol):
    """What a task needs from a model (engine/evaluation/eval_model.py on HF; a vLLM engine later)."""

    def sample(self, prompts: list[Prompt], params: SamplingParams) -> Rollouts: ...
    def score(self, rollouts: Rollouts) -> torch.Tensor: ...
    def score_full(self, rollouts: Rollouts) -> torch.Tensor: ...
    def encode_examples(self, examples: list[Prompt], max_tokens: int) -> Rollouts: ...
    def vocab_fingerprint(self) -> tuple[int, str]: ...
    def reader_for(self, teacher: "EvalModel") -> Any:
        """How `teacher` reads this model's text (engine/teachers/text_reading.py TextReader: teacher_view,
        student_view, chunks), for the per-byte KL between models of different tokenizers."""
        ...


@dataclass
class PreparedTask:
    """A task with its rows loaded and checked: prompts (or NLL examples) and per-row metadata."""

    spec: Any  # one of the eval_schema task models
    prompts: list[Prompt]
    metas: list[dict] = field(default_factory=list)
    label: str = ""
    pool: RewardPool | None = None  # generation: the verifier


@dataclass
class EvalContext:
    recipe: EvalRecipe
    teacher: Callable[[str], EvalModel]  # opens (once) and returns a teacher by name
    twin: Callable[[str], EvalModel]  # the full-precision model of an FP8 entry (kept open by the harness)
    teacher_samples: dict[tuple[str, str], list[Rollouts]] = field(default_factory=dict)
    samples: list[dict] = field(default_factory=list)  # a few completions per (model, task), for samples.jsonl

    def params(self, task: Any, batch_index: int) -> SamplingParams:
        """Each batch has its own seed; the same for every model, so models see paired draws."""
        s = self.recipe.sampling
        return SamplingParams(task.max_new_tokens or s.max_new_tokens, task.temperature or s.temperature, s.top_p,
                              self.recipe.seed + batch_index)

    def batches(self, items: list) -> list[list]:
        size = self.recipe.sampling.batch_size
        return [items[i:i + size] for i in range(0, len(items), size)]


def record(entry: ModelEntry, task: PreparedTask, ctx: EvalContext, metric: str, estimate: Estimate, n: int,
           **extra: Any) -> dict:
    return {"model": entry.name, "role": entry.role, "group": entry.group, "step": entry.step,
            "fp8_of": entry.fp8_of, "task": task.spec.name, "kind": task.spec.kind, "metric": metric,
            "value": estimate.value, "ci_low": estimate.low, "ci_high": estimate.high, "ci_method": estimate.method,
            "confidence": estimate.confidence, "n": n, "seed": ctx.recipe.seed, **extra}


def units(ids: list[str], numerators: list[float], denominators: list[float]) -> dict:
    """A record's per-unit sums (metric = Σ numerators / Σ denominators over the units), kept so
    that two models measured on the same units compare paired (track/report.py, the FP8 table)."""
    return {"unit_ids": list(ids), "units": [[float(a), float(t)] for a, t in zip(numerators, denominators)]}


def _prompt_text(prompt: Prompt) -> str:
    return prompt.messages[-1][1]


def run_generation(ctx: EvalContext, entry: ModelEntry, model: EvalModel, task: PreparedTask) -> list[dict]:
    """n samples per prompt, each verified; pass@k per prompt from its count of correct samples."""
    n = task.spec.samples
    rows = [i for i in range(len(task.prompts)) for _ in range(n)]  # prompt i repeated n times
    texts: list[str] = []
    for b, batch in enumerate(ctx.batches(rows)):
        texts += model.sample([task.prompts[i] for i in batch], ctx.params(task.spec, b)).texts
    assert task.pool is not None
    scored = task.pool.score([_prompt_text(task.prompts[i]) for i in rows], texts, [task.metas[i] for i in rows])
    correct = [0] * len(task.prompts)
    for i, reward in zip(rows, scored.rewards):
        correct[i] += int(reward >= 1.0 - 1e-9)  # a pass is full marks (all tests, the right answer)
    for i in range(min(SAMPLES_KEPT, len(task.prompts))):
        ctx.samples.append({"model": entry.name, "task": task.spec.name, "id": task.prompts[i].uid,
                            "prompt": _prompt_text(task.prompts[i]), "completion": texts[i * n],
                            "reward": scored.rewards[i * n]})
    extra = {"samples_per_prompt": n, "verifier": task.spec.verifier, "verifier_errors": scored.num_failures,
             "mean_reward": sum(scored.rewards) / max(len(rows), 1)}
    out = []
    ids = [p.uid for p in task.prompts]
    for k in sorted(set(task.spec.k)):
        per_prompt = mean_pass_at_k(n, correct, k)
        out.append(record(entry, task, ctx, f"pass@{k}", rate_estimate(per_prompt, ctx.recipe.confidence),
                          len(per_prompt), **extra, **units(ids, per_prompt, [1.0] * len(per_prompt))))
    return out


def _kl_record(entry, task, ctx, metric, kl_sums: list[torch.Tensor], tokens: list[torch.Tensor], **extra) -> dict:
    kl, count = torch.cat(kl_sums), torch.cat(tokens)
    estimate = bootstrap_ratio(kl, count, ctx.recipe.confidence, seed=ctx.recipe.seed)
    return record(entry, task, ctx, metric, estimate, int(kl.numel()), tokens=int(count.sum()), **extra)


def run_kl(ctx: EvalContext, entry: ModelEntry, model: EvalModel, task: PreparedTask) -> list[dict]:
    """Exact reverse KL(student‖teacher) on the student's samples and forward KL(teacher‖student)
    on the teacher's samples (drawn once per teacher and task, the same for every student): per
    token for a teacher with the model's tokenizer, per byte of text for any other."""
    names = task.spec.teachers or list(ctx.recipe.teachers)
    teachers = {name: ctx.teacher(name) for name in names}
    same = {name: t for name, t in teachers.items() if model.vocab_fingerprint() == t.vocab_fingerprint()}
    mine = [model.sample(batch, ctx.params(task.spec, b)) for b, batch in enumerate(ctx.batches(task.prompts))]
    out = _exact_kl(ctx, entry, model, task, same, mine) if same else []
    for name, teacher in teachers.items():
        if name not in same:
            out += _per_byte_kl(ctx, entry, model, task, name, teacher, mine)
    return out


def _teacher_samples(ctx: EvalContext, task: PreparedTask, name: str, teacher: EvalModel) -> list[Rollouts]:
    key = (task.spec.name, name)
    if key not in ctx.teacher_samples:
        ctx.teacher_samples[key] = [teacher.sample(batch, ctx.params(task.spec, b))
                                    for b, batch in enumerate(ctx.batches(task.prompts))]
    return ctx.teacher_samples[key]


def _byte_logratios(reader, model: EvalModel, teacher: EvalModel, rollouts: Rollouts, direction: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the sequence log-ratio of the aligned text (algo/cross_tokenizer.py) and its bytes."""
    theirs, views = reader.teacher_view(rollouts)
    teacher_BU = teacher.score(theirs).float()
    s_BT, t_BU = reader.chunks(views, rollouts.completion_ids_BT.shape[1], teacher_BU.shape[1])
    ratio_B = aligned_logratios(model.score(rollouts).float(), teacher_BU, s_BT, t_BU, direction)
    return ratio_B, torch.tensor([float(v.aligned_bytes) for v in views], dtype=torch.float64)


def _per_byte_kl(ctx: EvalContext, entry: ModelEntry, model: EvalModel, task: PreparedTask, name: str,
                 teacher: EvalModel, mine: list[Rollouts]) -> list[dict]:
    """Σ (log π_S(y) − log π_T(y)) / Σ bytes(y) on the model's samples (reverse) and the negation on
    the teacher's (forward), each side its own tokenization of the same text: the KL per byte,
    comparable across tokenizers (docs/losses.md, "Teachers with another tokenizer")."""
    reader = model.reader_for(teacher)
    reverse = [_byte_logratios(reader, model, teacher, rollouts, "reverse") for rollouts in mine]
    forward = [_byte_logratios(reader, model, teacher, reader.student_view(theirs), "forward")
               for theirs in _teacher_samples(ctx, task, name, teacher)]
    out = []
    for metric, parts in (("reverse_kl_per_byte", reverse), ("forward_kl_per_byte", forward)):
        ratios, sizes = torch.cat([r for r, _ in parts]), torch.cat([n for _, n in parts])
        estimate = bootstrap_ratio(ratios, sizes, ctx.recipe.confidence, seed=ctx.recipe.seed)
        out.append(record(entry, task, ctx, metric, estimate, int(ratios.numel()), bytes=int(sizes.sum()),
                          teacher=name))
    return out


def _exact_kl(ctx: EvalContext, entry: ModelEntry, model: EvalModel, task: PreparedTask,
              teachers: dict[str, EvalModel], mine: list[Rollouts]) -> list[dict]:
    names = list(teachers)
    reverse = {name: ([], []) for name in names}
    forward = {name: ([], []) for name in names}
    for rollouts in mine:
        mine_full = model.score_full(rollouts)
        for name, teacher in teachers.items():
            reverse[name][0].append(sequence_kl(mine_full, teacher.score_full(rollouts), rollouts.loss_mask_BT))
            reverse[name][1].append(rollouts.loss_mask_BT.sum(dim=1))
    for name, teacher in teachers.items():
        for theirs in _teacher_samples(ctx, task, name, teacher):
            forward[name][0].append(sequence_kl(teacher.score_full(theirs), model.score_full(theirs),
                                                theirs.loss_mask_BT))
            forward[name][1].append(theirs.loss_mask_BT.sum(dim=1))
    out = []
    for name in names:
        out.append(_kl_record(entry, task, ctx, "reverse_kl", *reverse[name], teacher=name))
        out.append(_kl_record(entry, task, ctx, "forward_kl", *forward[name], teacher=name))
    return out


def run_nll(ctx: EvalContext, entry: ModelEntry, model: EvalModel, task: PreparedTask) -> list[dict]:
    """Token-mean NLL of the reference replies (nats/token), and its perplexity exp(NLL)."""
    nll, tokens = [], []
    for batch in ctx.batches(task.prompts):
        rollouts = model.encode_examples(batch, task.spec.max_tokens)
        nll.append(sequence_nll(model.score(rollouts), rollouts.loss_mask_BT))
        tokens.append(rollouts.loss_mask_BT.sum(dim=1))
    estimate = bootstrap_ratio(torch.cat(nll), torch.cat(tokens), ctx.recipe.confidence, seed=ctx.recipe.seed)
    count = int(torch.cat(tokens).sum())
    per_reply = units([p.uid for p in task.prompts], torch.cat(nll).tolist(), torch.cat(tokens).tolist())
    # exp is increasing, so the interval's ends map to the perplexity interval's ends.
    ppl = Estimate(math.exp(estimate.value), math.exp(estimate.low), math.exp(estimate.high), estimate.method,
                   estimate.confidence)
    return [record(entry, task, ctx, "nll", estimate, len(task.prompts), tokens=count, **per_reply),
            record(entry, task, ctx, "perplexity", ppl, len(task.prompts), tokens=count)]


def run_fp8_gap(ctx: EvalContext, entry: ModelEntry, model: EvalModel, task: PreparedTask) -> list[dict]:
    """KL(full precision ‖ FP8) on the full-precision model's samples, and how often the two agree
    on the most likely next token (top-1 agreement)."""
    assert entry.fp8_of is not None
    full = ctx.twin(entry.fp8_of)
    kl, tokens, agree = [], [], []
    for b, batch in enumerate(ctx.batches(task.prompts)):
        rollouts = full.sample(batch, ctx.params(task.spec, b))
        full_BTV, fp8_BTV = full.score_full(rollouts), model.score_full(rollouts)
        mask_BT = rollouts.loss_mask_BT
        kl.append(sequence_kl(full_BTV, fp8_BTV, mask_BT))
        same_BT = (full_BTV.argmax(dim=-1) == fp8_BTV.argmax(dim=-1)).double()
        agree.append((same_BT * mask_BT.double()).sum(dim=1))
        tokens.append(mask_BT.sum(dim=1))
    extra = {"reference_model": entry.fp8_of}
    return [_kl_record(entry, task, ctx, "fp8_kl", kl, tokens, **extra),
            _kl_record(entry, task, ctx, "top1_agreement", agree, tokens, **extra)]


def _pooled(counts: list[tuple[float, float]], ctx: EvalContext, empty: float) -> Estimate:
    """Σ a_i / Σ t_i over completions with a bootstrap interval; `empty` when no completion counts."""
    if sum(t for _, t in counts) <= 0:
        return Estimate(empty, empty, empty, "none", ctx.recipe.confidence)
    return bootstrap_ratio([a for a, _ in counts], [t for _, t in counts], ctx.recipe.confidence, seed=ctx.recipe.seed)


def run_text(ctx: EvalContext, entry: ModelEntry, model: EvalModel, task: PreparedTask) -> list[dict]:
    """One sample per prompt: mean length (tokens), distinct-n and repetition rate of the words
    (pooled over completions, bootstrap over completions) and the behaviour score's rate (Wilson
    over prompts) if the task names one."""
    spec, texts, lengths = task.spec, [], []
    for b, batch in enumerate(ctx.batches(task.prompts)):
        rollouts = model.sample(batch, ctx.params(spec, b))
        texts += rollouts.texts
        lengths += rollouts.loss_mask_BT.sum(dim=1).tolist()
    for i in range(min(SAMPLES_KEPT, len(texts))):
        ctx.samples.append({"model": entry.name, "task": spec.name, "id": task.prompts[i].uid,
                            "prompt": _prompt_text(task.prompts[i]), "completion": texts[i]})
    n = len(texts)
    distinct = [ngram_counts(t, spec.distinct_n) for t in texts]
    repeated = [ngram_counts(t, spec.repetition_n) for t in texts]
    out = [record(entry, task, ctx, "length", _pooled([(x, 1.0) for x in lengths], ctx, 0.0), n),
           record(entry, task, ctx, f"distinct_{spec.distinct_n}", _pooled(distinct, ctx, 1.0), n),
           record(entry, task, ctx, f"repetition_{spec.repetition_n}",
                  _pooled([(t - d, t) for d, t in repeated], ctx, 0.0), n)]
    if spec.score is not None:
        rates = [behaviour_score(spec.score, t) for t in texts]
        out.append(record(entry, task, ctx, spec.score, rate_estimate(rates, ctx.recipe.confidence), n))
    return out


TASK_RUNNERS: dict[str, Callable[[EvalContext, ModelEntry, EvalModel, PreparedTask], list[dict]]] = {
    "generation": run_generation, "kl": run_kl, "nll": run_nll, "fp8_gap": run_fp8_gap, "text": run_text,
}


def applies(kind: str, entry: ModelEntry) -> bool:
    """Which models a task kind evaluates: KL is for students (against teachers), fp8_gap for FP8 twins."""
    if kind == "kl":
        return entry.role == "student"
    if kind == "fp8_gap":
        return entry.fp8_of is not None
    return True
