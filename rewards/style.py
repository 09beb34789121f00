"""Style rewards: does a reply follow a house style rule?

    opens_with(prompt: str, completion: str, meta: dict) -> float

opens_with: 1.0 if the completion, leading white space stripped, starts with meta["answer"]
(case-insensitive), else 0.0. With the eval set `builtin:style-chat` (every row's answer is the
opening "In short:") it measures an opening rule for a style teacher that follows one; the
135M SmolLM2 teacher of recipes/teachers/smollm2-style.yaml does not (0 of 32 replies), so the
context-distillation eval measures brevity instead (the `brief` score of a `text` task).
"""

from __future__ import annotations


def opens_with(prompt: str, completion: str, meta: dict) -> float:
    opening = str(meta.get("answer", "")).strip().lower()
    return 1.0 if opening and completion.lstrip().lower().startswith(opening) else 0.0
