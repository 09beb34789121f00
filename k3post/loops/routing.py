"""Routing rows of a batch to their teachers and putting the answers back in place."""

from __future__ import annotations

import torch

from k3post.loops.protocols import Pending, TeacherGroup
from k3post.types import Prompt, Rollouts


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
