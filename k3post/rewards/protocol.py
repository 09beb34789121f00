"""The reward protocol: one signature for every rule reward, and how several rewards combine.

A reward function is any callable

    score(prompt: str, completion: str, meta: dict) -> float | dict[str, float]

- `prompt`: the prompt as the model saw it (text); `completion`: the model's answer text;
  `meta`: the data row's extra fields (e.g. `answer` for math, `tests` for code). It must not
  be mutated. Extra keyword-only parameters (a target length, say) are bound from the recipe
  (`RewardSpec.kwargs`).
- A float is the reward.
- A dict is named components for metrics and MUST contain the key "reward": that value is the
  reward; every other key is a diagnostic logged as `rl/reward/<name>/<key>` and never enters
  the optimisation. (We chose "must contain reward" over "values are summed": summing makes
  every diagnostic part of the objective by accident, e.g. a `num_tests` count.)
- Values must be finite real numbers (bools count as 0/1). Anything else is an error of that
  reward for that sample (see pool.py: it scores 0 and is counted, the run goes on).

Several rewards combine linearly, R = Σ_i w_i r_i (`combine_rewards`), and each r_i is logged
unweighted as `rl/reward/<name>`, so a weight change does not rescale the curves.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

REWARD_KEY = "reward"
METRIC_PREFIX = "rl/reward/"


class RewardFn(Protocol):
    def __call__(self, prompt: str, completion: str, meta: dict) -> float | dict[str, float]: ...


@dataclass(frozen=True)
class RewardSpec:
    """One reward of a recipe: its metric name, the function, its weight and bound kwargs."""

    name: str
    fn: Callable[..., Any]
    weight: float = 1.0
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __call__(self, prompt: str, completion: str, meta: dict) -> float | dict[str, float]:
        return self.fn(prompt, completion, meta, **self.kwargs)


@dataclass(frozen=True)
class ScoredSample:
    """The combined reward of one completion.

    reward: Σ_i w_i r_i. components: metric name → value (`rl/reward/<name>`, unweighted, and
    `rl/reward/<name>/<key>` for a dict's extra keys; `rl/reward/<name>/error` = 1.0 where that
    reward failed). errors: reward name → what went wrong (that reward counted as 0).
    """

    reward: float
    components: dict[str, float]
    errors: dict[str, str] = field(default_factory=dict)


def _as_number(value: Any, what: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or isinstance(value, complex):
        raise TypeError(f"{what} must be a real number, got {type(value).__name__}: {value!r}"[:300])
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{what} must be finite, got {number}")
    return number


def normalize_output(name: str, output: Any) -> tuple[float, dict[str, float]]:
    """A reward function's return value → (reward, extra components); raises on a bad value."""
    if isinstance(output, Mapping):
        if REWARD_KEY not in output:
            raise ValueError(f"reward {name!r} returned a dict without the key {REWARD_KEY!r}: keys {sorted(output)}")
        extras = {
            str(k): _as_number(v, f"reward {name!r} component {k!r}") for k, v in output.items() if k != REWARD_KEY
        }
        return _as_number(output[REWARD_KEY], f"reward {name!r}"), extras
    return _as_number(output, f"reward {name!r}"), {}


def combine_rewards(
    specs: Sequence[RewardSpec], outputs: Mapping[str, Any], errors: Mapping[str, str] | None = None
) -> ScoredSample:
    """R = Σ_i w_i r_i over `specs`, with the metrics of each reward.

    `outputs[name]` is the raw return value of reward `name`; a name in `errors` (or whose output
    is malformed) counts as r = 0 and is reported in `errors`, never raised: one bad sample must
    not stop a run.
    """
    errors = dict(errors or {})
    total, components = 0.0, {}
    for spec in specs:
        prefix = METRIC_PREFIX + spec.name
        value, extras = 0.0, {}
        if spec.name not in errors:
            try:
                value, extras = normalize_output(spec.name, outputs.get(spec.name))
            except (TypeError, ValueError) as error:
                errors[spec.name] = str(error)
        total += spec.weight * value
        components[prefix] = value
        components.update({f"{prefix}/{key}": extra for key, extra in extras.items()})
        if spec.name in errors:
            components[f"{prefix}/error"] = 1.0
    return ScoredSample(reward=total, components=components, errors=errors)
