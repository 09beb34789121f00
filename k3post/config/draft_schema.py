"""`draft:` recipe keys — a draft head trained with the student, and speculative rollouts with it.

kind: mtp grafts an MTP-1 head onto the student (model/generation/draft_head.py): it learns, from the
learner's own forward and with its own AdamW, to predict the token after next as the student
would (no gradient reaches the student). `speculate` makes the HF samplers draft `tokens` tokens
with it and verify them in one student forward (algo/speculative.py: the samples keep the
student's exact distribution). Off by default.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, model_validator

from k3post.config.base import Strict


class SpeculateSpec(Strict):
    tokens: int = Field(2, ge=1, le=8, description="K: draft tokens proposed per student verify forward")
    min_accept: float = Field(0.5, ge=0, description=(
        "speculation turns itself off (one log line) while the mean accepted draft tokens per verify falls below "
        "this, or below what the measured cost of a verify step against a decode step needs to pay"))


class DraftSpec(Strict):
    kind: Literal["none", "mtp"] = Field("none", description=(
        "none: no draft head; mtp: an MTP-1 head (DeepSeek-V3 layout, its block a copy of the student's last) "
        "trained on the learner's forward to predict the token after next as the student does"))
    hidden: Literal["final_norm", "residual"] = Field("final_norm", description=(
        "the student's hidden state the head reads: final_norm, after the student's final norm; residual, before "
        "it (with the embedding at position 0 zeroed and the head's output normalised by the student's final "
        "norm): the MTP layer vLLM's `mtp` method runs for a MiMo checkpoint, which `k3post export-draft` writes, "
        "so only a residual head is served by vLLM exactly (docs/engines.md)"))
    loss_coef: PositiveFloat = Field(1.0, description="scale of the head's soft cross-entropy (its own optimizer)")
    lr: PositiveFloat = Field(1e-3, description="the head's AdamW learning rate (constant)")
    speculate: SpeculateSpec | None = Field(None, description=(
        "draft with the head in the HF samplers (distill and rl recipes; sampling.engine: hf); null: train only"))

    @model_validator(mode="after")
    def _keys_need_a_head(self) -> "DraftSpec":
        # Compared with the defaults, not with the keys written: a resolved recipe spells every default out.
        given = sorted(name for name, spec in type(self).model_fields.items()
                       if name != "kind" and getattr(self, name) != spec.default)
        if self.kind == "none" and given:
            raise ValueError(f"draft.{given[0]}: applies to a draft head; set draft.kind: mtp (or remove the key)")
        return self


def check_draft(draft: DraftSpec, sampling, samples: bool = True) -> None:
    """A draft that could not run as asked is an error at load: speculation in a recipe that
    samples nothing, in the vLLM sampler, or in the static-cache engine. (A sharded learner shards
    the head like a block: engine/sharded/sharded_draft.py.)"""
    if draft.kind == "none":
        return
    if draft.speculate is not None and not samples:
        raise ValueError("draft.speculate: an SFT run samples nothing; remove it (the head still trains)")
    if draft.speculate is not None and sampling.engine != "hf":
        raise ValueError(f"draft.speculate: speculative rollouts run in the HF samplers; set sampling.engine: hf "
                         f"(got {sampling.engine}) or remove draft.speculate")
