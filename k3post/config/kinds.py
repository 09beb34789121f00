"""Every recipe kind k3post trains, by its `kind:` value (and teacher files)."""

from __future__ import annotations

from k3post.config.base import Strict
from k3post.config.rl_schema import RlRecipe
from k3post.config.schema import DistillRecipe, TeacherSpec
from k3post.config.sft_schema import SftRecipe

RECIPE_KINDS: dict[str, type[Strict]] = {"distill": DistillRecipe, "sft": SftRecipe, "rl": RlRecipe,
                                         "teacher": TeacherSpec}
