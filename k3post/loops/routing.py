"""Routing rows of a batch to their teachers and putting the answers back in place."""

from __future__ import annotations

import torch

from typing import Any

from k3post.loops.protocols import Pending, TeacherGroup
from k3post.types import Prompt, Rollouts, TeacherPart, tensor_bytes


def rows_by_teacher(prompts: list[Prompt]) -> dict[str, list[int]]:
    """Row indices per teacher, teachers in order of first appearance."""
    rows: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        rows.setdefault(prompt.teacher, []).append(i)
    return rows


def score_routed(teachers: dict[str, TeacherGroup], rollouts: Rollouts, full: bool = False) -> torch.Tensor:
    """Every row scored by its own teacher; all teachers are asked before any answer is awaited,
    so teacher groups on separate actors work at the same time. [B, T] (or [B, T, V] if full)."""
    pending: dict[str, tuple[list[int], Pending[torch.Tensor]]] = {}
    for name, rows in rows_by_teacher(rollouts.prompts).items():
        part = rollouts.select(rows)
        pending[name] = (rows, teachers[name].score_full(part) if full else teachers[name].score(part))
    out = None
    for rows, handle in pending.values():
        values = handle.result()
        if out is None:
            out = values.new_zeros((len(rollouts),) + tuple(values.shape[1:]))
        out[torch.tensor(rows)] = values
    assert out is not None, "empty batch"
    return out


def score_for_learner(teachers: dict[str, TeacherGroup], scoring: dict[str, tuple[str, tuple]], rollouts: Rollouts,
                      in_turn: frozenset[str] = frozenset()) -> tuple[torch.Tensor, tuple[TeacherPart, ...], list[Any], int]:
    """Every row scored by its own teacher with the method its loss needs (`scoring[name]`:
    "score", or "score_topk"/"score_with_full"/"score_with_hidden" and their arguments).

    Returns the [B, T] logprobs of the sampled tokens (all the driver keeps), the teacher parts
    for the TrainBatch, the payload handles they point to (`train_step`'s extra arguments: on Ray
    ObjectRefs, never fetched here), and the bytes the driver received. All teachers are asked
    before any answer is awaited, except those `in_turn` (a fleet sharing one GPU by sleeping:
    engine/vllm/sleep.py): each of those is asked once the one before it has answered, so that one
    is awake at a time. Each teacher is asked once, for all its rows, so it wakes once a step."""
    pending, parts, payloads = [], [], []
    last_turn = None
    for name, rows in rows_by_teacher(rollouts.prompts).items():
        method, args = scoring[name]
        if name in in_turn and last_turn is not None:
            last_turn.result()  # the teacher before is asleep again before this one wakes
        part = rollouts.select(rows)
        if method == "score":
            pending.append((rows, teachers[name].score(part)))
            parts.append(TeacherPart(name, tuple(rows)))
            last_turn = pending[-1][1] if name in in_turn else last_turn
            continue
        summary, handles = teachers[name].score_parts(part, method, *args)
        pending.append((rows, summary))
        last_turn = summary if name in in_turn else last_turn
        parts.append(TeacherPart(name, tuple(rows), slots=tuple(range(len(payloads), len(payloads) + len(handles)))))
        payloads += handles
    out, received = rollouts.sampler_logprobs_BT.new_zeros(rollouts.sampler_logprobs_BT.shape), 0
    for rows, handle in pending:
        values = handle.result()
        received += tensor_bytes(values)
        out[torch.tensor(rows)] = values.to(out.dtype)
    return out, tuple(parts), payloads, received


def teachers_in_turn(teachers: dict[str, Any]) -> frozenset[str]:
    """The teachers that share a GPU by sleeping between turns (`engine: vllm` with `vllm.sleep`)."""
    return frozenset(name for name, spec in teachers.items() if spec.engine == "vllm" and spec.vllm.sleep)


def prefix_metrics(counts: dict[str, float], teacher: str) -> dict[str, float]:
    """The per-teacher metrics of one step from summed `prefix_counts` (engine/teachers/teacher_prefix.py;
    a sleeping vLLM teacher's sleep/wake seconds and free GPU memory: engine/vllm/sleep.py)."""
    if "prompt_tokens" not in counts:  # it scored nothing since the last step, or it is vLLM: sleep counts, if any
        return {f"teacher/{key}/{teacher}": value for key, value in counts.items()}
    prompt = max(counts["prompt_tokens"], 1.0)
    return {f"teacher/prefix_tokens_reused/{teacher}": counts["prompt_tokens"] - counts["prompt_tokens_encoded"],
            f"teacher/prompt_tokens_encoded/{teacher}": counts["prompt_tokens_encoded"],
            f"teacher/prompt_reuse/{teacher}": 1.0 - counts["prompt_tokens_encoded"] / prompt,
            f"teacher/fallback_rows/{teacher}": counts.get("fallback_rows", 0.0),
            f"teacher/score_seconds/{teacher}": counts.get("score_seconds", 0.0)}
