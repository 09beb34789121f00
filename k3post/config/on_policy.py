"""Where `sampling.on_policy: bitwise` can hold, checked when a recipe loads.

Bitwise mode promises that the learner's log π(y_t) equals the sampler's recorded log μ(y_t) bit
for bit (model/batch_invariant.py; docs/on-policy.md). This release builds it for the HF sampler
(dynamic or static cache; `sampling.compile` there records the mode's eager decode step as a CUDA
graph instead of compiling it) and one unsharded learner, on CPUs or on GPUs (both on the same kind
of device), under FP8 QAT too when the rollouts are on its grid (`sampling.weights: fp8`: both
sides then compute x̃·W̃ᵀ from equal dequantised operands). Every other path either computes one
side with other kernels (vLLM, speculative decoding, torch.compile, FSDP's mixed precision),
computes other arithmetic (LoRA's base + B·A against the sampler's merged weights), samples from
another policy (QAT with unquantised rollouts) or with other weights (async rollouts are one update
old): there the promise cannot hold, so the recipe is refused at load with the key to change,
rather than stopped at its first step.
"""

from __future__ import annotations


def on_policy_conflicts(recipe) -> list[tuple[str, str, str]]:
    """(key, why, what to set instead) for each setting of a distill or RL recipe that bitwise mode
    does not cover, in the order they are reported."""
    sampling, res, learner = recipe.sampling, recipe.resources, recipe.learner
    found = [
        (sampling.engine == "vllm", "sampling.engine: vllm", "vLLM's CPU kernels are not batch-invariant against the "
         "learner's, and its batch-invariant mode is for GPUs", "sampling.engine: hf"),
        (recipe.draft.speculate is not None, "draft.speculate", "speculative decoding verifies several tokens per "
         "forward with the draft head's kernels", "no draft.speculate"),
        (recipe.lora.rank > 0, "lora.rank", "the learner computes x·Wᵀ + x·(B·A)ᵀ while the sampler holds the merged "
         "weights: other arithmetic", "lora.rank: 0"),
        (recipe.qat.enabled and sampling.weights != "fp8", "qat.enabled", "the learner computes the fake-quantised "
         "forward while the sampler draws from the unquantised weights: another policy",
         "sampling.weights: fp8 (rollouts on the QAT grid)"),
        (recipe.train.compile, "train.compile", "compiled kernels fuse and reorder the reductions",
         "train.compile: false"),
        (res.learner.replicas > 1, "resources.learner.replicas", "a sharded learner (FSDP2) is not covered",
         "resources.learner.replicas: 1"),
        (learner.sharding == "always", "learner.sharding: always", "a sharded learner (FSDP2) is not covered",
         "learner.sharding: auto"),
        (learner.precision == "bf16-mixed", "learner.precision: bf16-mixed", "the learner would compute in bf16 "
         "from fp32 master weights, the sampler in the student's dtype", "learner.precision: auto"),
        ((res.learner.num_gpus > 0) != (res.samplers.num_gpus > 0), "resources.samplers.num_gpus",
         "the sampler and the learner must both run on GPUs or both on CPUs: the two devices' kernels round "
         "differently", "the same device for both"),
        (recipe.student.kimi is not None, "student.kimi", "Kimi Linear's KDA and MoE layers are not covered",
         "a Llama, Mistral, Qwen2 or Qwen3 student"),
        (getattr(recipe.train, "mode", "sync") == "async", "train.mode: async", "async rollouts are drawn with "
         "weights one update older than the learner's", "train.mode: sync"),
    ]
    return [(key, why, instead) for conflict, key, why, instead in found if conflict]


def check_on_policy(recipe) -> None:
    """Refuse a bitwise recipe on a path the mode does not cover: one message naming both keys."""
    if recipe.sampling.on_policy != "bitwise":
        return
    conflicts = on_policy_conflicts(recipe)
    if conflicts:
        key, why, instead = conflicts[0]
        raise ValueError(f"sampling.on_policy: bitwise does not cover {key} ({why}); set {instead}, or "
                         f"sampling.on_policy: off. Bitwise mode is built for sampling.engine: hf "
                         f"and one unsharded learner, on CPUs or GPUs (docs/on-policy.md)")
