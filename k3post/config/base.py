"""The base of every recipe model: frozen, and unknown keys are errors (a typo in a recipe fails at
load time instead of being silently ignored)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
