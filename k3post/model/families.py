"""The model families k3post accepts, and what each does to its logits after the output head.

Why a table. OPD is only as correct as the agreement of three log-probabilities of the same
tokens: the sampler's log μ, the learner's log π and the teacher's log π_T. The sampler takes its
logits from the model's own forward (`generate`, or `forward` in the fast engine); the learner and
the teachers' chunked paths compute z = h·Wᵀ themselves from the final hidden state h and the head
W, chunk by chunk, so that no [N, V] block of logits is ever held whole (model/scoring/logprobs.py,
engine/teachers/teacher.py). Some families do more than h·Wᵀ in their forward:

    Gemma-2, Gemma-3 text   z ↦ c · tanh(z / c)     c = config.final_logit_softcapping (None: off)
    Granite                 z ↦ z / s               s = config.logits_scaling
    Cohere                  z ↦ z · s               s = config.logit_scale

A chunked path that skips that step models a different distribution from the one the tokens were
drawn from, silently: the importance ratios are off by a per-token factor at equal weights. So the
chunked paths apply `logit_transform(config)` to every chunk of logits, and a model whose family
is not in the table (whose forward k3post has not checked) is refused at load
(model/loading/checks.py: `check_family`), rather than trained with a learner that may disagree with it.

Every family here is covered by tests/unit/test_family_parity.py: a tiny random model from the
family's own transformers config class, sampled and scored through the real code paths, with
sampler log μ == learner log π == teacher log π_T == the model's own forward (fp32, 1e-5).
Adding a family means adding a row here and a config to that test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class LogitTransform:
    """z ↦ c·tanh(s·z / c) (the tanh only when `softcap` c is set; s = `scale`): what a family's
    forward does to h·Wᵀ. The identity is `LogitTransform()`. Applied before the temperature, as
    the model's forward is what `generate` divides by the temperature."""

    scale: float = 1.0
    softcap: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap is not None:
            logits = self.softcap * torch.tanh(logits / self.softcap)
        return logits

    @property
    def is_identity(self) -> bool:
        return self.scale == 1.0 and self.softcap is None


IDENTITY = LogitTransform()


def _identity(config: Any) -> LogitTransform:
    return IDENTITY


def _softcap(config: Any) -> LogitTransform:
    cap = getattr(config, "final_logit_softcapping", None)
    return LogitTransform(softcap=float(cap)) if cap else IDENTITY


def _granite(config: Any) -> LogitTransform:
    return LogitTransform(scale=1.0 / float(config.logits_scaling))


def _cohere(config: Any) -> LogitTransform:
    return LogitTransform(scale=float(config.logit_scale))


# config.model_type -> (what it is, the transform its CausalLM forward applies after the head).
FAMILIES: dict[str, tuple[str, Callable[[Any], LogitTransform]]] = {
    "llama": ("Llama 2/3, SmolLM2, k3post's tiny test model", _identity),
    "mistral": ("Mistral", _identity),
    "qwen2": ("Qwen2 / Qwen2.5", _identity),
    "qwen3": ("Qwen3 dense", _identity),
    "qwen3_moe": ("Qwen3 MoE", _identity),
    "gemma2": ("Gemma 2: final-logit soft-capping", _softcap),
    "gemma3_text": ("Gemma 3 text-only (the 1B; not the multimodal 'gemma3'): soft-capping when set", _softcap),
    "phi3": ("Phi-3 / Phi-4", _identity),
    "granite": ("Granite 3 dense: logits / logits_scaling", _granite),
    "cohere": ("Cohere Command-R: logits * logit_scale", _cohere),
    "olmo2": ("OLMo 2", _identity),
    "kimi_linear": ("Kimi Linear (KDA + MLA + MoE; k3post's Kimi students)", _identity),
}
ACCEPTED = tuple(sorted(FAMILIES))


def logit_transform(config: Any) -> LogitTransform:
    """The transform the family of `config` (a transformers config) applies to h·Wᵀ.

    A config whose model_type is not in FAMILIES gets the identity here: refusing it is the
    loader's job (`check_family`), and models built in code (tiny, Kimi) are in the table."""
    family = FAMILIES.get(getattr(config, "model_type", ""))
    return IDENTITY if family is None else family[1](config)


def model_logit_transform(model: torch.nn.Module) -> LogitTransform:
    """`logit_transform` of a loaded model (an FSDP-wrapped one keeps its config)."""
    return logit_transform(model.config)


def unaccepted_family(model_type: Any) -> str | None:
    """Why a model_type is refused (None when accepted): names it and the accepted list."""
    if model_type in FAMILIES:
        return None
    return (f"model_type {model_type!r} is not a model family k3post accepts; accepted: {', '.join(ACCEPTED)} "
            f"(each is checked for sampler/learner/teacher log-prob parity; docs/engines.md#model-families)")
