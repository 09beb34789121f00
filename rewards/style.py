"""Style rewards: does a reply follow a house style rule?

    opens_with(prompt: str, completion: str, meta: dict) -> float

opens_with: 1.0 if the completion, leading white space stripped, starts with meta["answer"]
(case-insensitive), else 0.0. The context-distillation eval (recipes/eval/context-distill.yaml)
uses it with the eval set `builtin:style-chat`, whose every row's answer is the opening the style
guide mandates ("In short:").
"""

from __future__ import annotations


def opens_with(prompt: str, completion: str, meta: dict) -> float:
    opening = str(meta.get("answer", "")).strip().lower()
    return 1.0 if opening and completion.lstrip().lower().startswith(opening) else 0.0
