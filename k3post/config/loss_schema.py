"""A teacher's own OPD loss: the `loss:` key of a teacher YAML (recipes/teachers/*.yaml).

One run can distil a math teacher by the sampled-token reverse KL and a chat teacher by a top-k
JSD: each teacher names its loss, and a teacher that names none uses the recipe's `loss.kind`
and `loss.kl_coef` (`resolve_teacher_loss`), so recipes written before per-teacher losses load
and train as they did. The defaults of every key live here and nowhere else. The losses
themselves: algo/objectives.py (PerTeacherOPD) and algo/topk.py; docs/losses.md.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_serializer, model_validator

from k3post.config.base import Strict

TeacherLossKind = Literal["sampled_token", "full_vocab", "topk_forward", "topk_reverse", "topk_jsd"]
TOPK_KINDS = ("topk_forward", "topk_reverse", "topk_jsd")


class TeacherLossSpec(Strict):
    """sampled_token: the advantage A_t = −coef·(log μ − log π_T) under an importance-sampled policy
    gradient. full_vocab: the exact reverse KL over the vocabulary (`send`: the teacher's
    distributions, or its final hidden states and the learner applies its output head).
    topk_forward / topk_reverse / topk_jsd: KL(T‖S), KL(S‖T) or JSD(β) on the teacher's top-k ids
    plus one tail bucket (β = 0 is the forward KL, β = 1 the reverse)."""

    kind: TeacherLossKind = Field(description=(
        "sampled_token, full_vocab, or a top-k loss: topk_forward KL(T‖S), topk_reverse KL(S‖T), topk_jsd JSD(β)"))
    coef: PositiveFloat | None = Field(None, description="the term's weight; null: the recipe's loss.kl_coef")
    k: PositiveInt = Field(64, description="topk_*: how many of the teacher's most likely ids it sends per position")
    beta: float = Field(0.5, ge=0, le=1, description="topk_jsd: β of JSD(β), the mixture weight of the teacher "
                                                     "(0: the forward KL, 1: the reverse)")
    send: Literal["logprobs", "hidden_states"] = Field("logprobs", description=(
        "full_vocab: what the teacher ships; logprobs: its [B, T, V] distributions; hidden_states: its final "
        "hidden states, and the learner applies its output head"))

    def _applies(self, key: str) -> bool:
        kinds = {"k": TOPK_KINDS, "beta": ("topk_jsd",), "send": ("full_vocab",)}
        return key not in kinds or self.kind in kinds[key]

    @model_validator(mode="after")
    def _keys_of_this_kind(self) -> "TeacherLossSpec":
        for key in ("k", "beta", "send"):
            if key in self.model_fields_set and not self._applies(key):
                raise ValueError(f"`{key}` does not apply to loss kind {self.kind}")
        return self

    @model_serializer(mode="wrap")
    def _saved_keys_of_this_kind(self, handler):
        """The saved form (a run's recipe.resolved.yaml) holds only the keys of its kind, so that
        it loads again: a key of another kind, written out, would be refused above."""
        return {key: value for key, value in handler(self).items() if self._applies(key)}


def resolve_teacher_loss(own: TeacherLossSpec | None, recipe_kind: str, recipe_coef: float) -> TeacherLossSpec:
    """The teacher's loss with every key filled: its own, or the recipe's `loss.kind`; a coef it does
    not name is the recipe's `loss.kl_coef`."""
    spec = own or TeacherLossSpec(kind=recipe_kind)
    return spec if spec.coef is not None else spec.model_copy(update={"coef": recipe_coef})


class CrossTokenizerSpec(Strict):
    """How a teacher whose tokenizer is not the student's scores the student's text (the `cross_tokenizer:`
    key of a teacher YAML; the maths: k3post/algo/cross_tokenizer.py, docs/losses.md). A teacher with
    the student's tokenizer scores the student's ids directly and ignores nothing here: setting a key
    for it is an error at launch unless `mode: always`."""

    mode: Literal["auto", "always"] = Field(
        "auto", description="auto: the cross-tokenizer path only when the tokenizers differ; always: also for an "
                            "identical tokenizer (a check: it then gives the same advantages as the direct path)")
    split: Literal["uniform", "broadcast", "one_to_one"] = Field(
        "uniform", description="how a chunk's log-ratio L_S − L_T becomes per-student-token advantages: uniform "
                               "(the chunk's teacher logprob shared evenly), broadcast (every token gets the whole "
                               "chunk's), one_to_one (only chunks of one token on each side)")
    max_chunk_tokens: PositiveInt = Field(
        8, description="chunks with more tokens than this on either side carry no signal (advantage 0)")
    dense_support: Literal["exact", "prefix"] = Field(
        "exact", description="topk_* losses: the student tokens the teacher's next-token distribution is compared "
                             "on at 1:1 chunks; exact: the tokens whose strings both vocabularies hold; prefix: "
                             "every teacher token's mass moved onto the student token that is the longest byte "
                             "prefix of it (docs/losses.md)")
