"""The base of every recipe model: frozen, unknown keys are errors (a typo in a recipe fails at
load time instead of being silently ignored), and every float is finite.

`allow_inf_nan=False` makes pydantic refuse `.inf`, `-.inf` and `.nan` (all legal YAML floats) in
every float field of every section, nested tuples (`optim.betas`) included: `optim.lr: .inf`
validates as a positive float otherwise, and trains on NaNs. Free-form maps (a reward function's
`kwargs`) are the user's own values and pass as written.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)
