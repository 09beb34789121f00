"""Rule rewards for RL: the reward protocol, loading reward functions named by a recipe, running
them off the driver's critical path, and the sandbox for model-written code.

- protocol: `score(prompt, completion, meta) -> float | dict[str, float]`, RewardSpec,
  combine_rewards (R = Σ w_i r_i, per-reward metrics `rl/reward/<name>`).
- loader: load_reward("rewards.math:correctness"), make_reward_spec.
- pool: RewardPool (thread pool, per-call timeout, failures become 0 + an error, never a crash).
- sandbox: run_python(code, limits) -> SandboxResult (namespaces, read-only host, rlimits, ...).

The shipped reward functions live in the top-level `rewards/` package (docs/rewards.md). This
layer sits beside model/data: it may import torch, math-verify and k3post.config/types, never Ray.
"""

from k3post.rewards.loader import load_reward, make_reward_spec
from k3post.rewards.pool import RewardBatch, RewardPool
from k3post.rewards.protocol import RewardFn, RewardSpec, ScoredSample, combine_rewards, normalize_output
from k3post.rewards.sandbox import SandboxLimits, SandboxResult, run_python

__all__ = [
    "RewardBatch",
    "RewardFn",
    "RewardPool",
    "RewardSpec",
    "SandboxLimits",
    "SandboxResult",
    "ScoredSample",
    "combine_rewards",
    "load_reward",
    "make_reward_spec",
    "normalize_output",
    "run_python",
]
