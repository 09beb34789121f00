"""Where a model's weights come from (`ModelSpec`) and the models k3post builds itself: tiny
random Llamas for tests, Kimi Linear students and tokenizer transplants. Defaults live here
(part of the recipe schema, re-exported by config/schema.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.base import Strict


class TinyModelSpec(Strict):
    """A randomly initialised Llama-shaped model with the repo's tiny tokenizer (tests, smoke runs)."""

    hidden_size: PositiveInt = 64
    num_layers: PositiveInt = 2
    num_heads: PositiveInt = 4
    num_kv_heads: PositiveInt = 2
    intermediate_size: PositiveInt = 128
    seed: int = 0
    # Larger init gives peakier next-token distributions (a teacher with opinions, in tests).
    init_std: PositiveFloat = 0.02


class KimiSpec(Strict):
    """A randomly initialised Kimi Linear student (KDA linear attention + MLA + MoE).

    Layer i is MLA full attention when (i + 1) % full_attention_every == 0, else KDA (4 gives
    the ~3:1 KDA:MLA interleave of Kimi Linear); a model too short for that gets its last layer
    as MLA, so there is always one (generate needs a full-attention cache layer). The first
    `first_k_dense` layers have a dense MLP, the rest MoE. The student shares the tokenizer of
    `tokenizer_from` (vocabulary = its length); `init_embeddings_from` copies that model's input
    embedding and LM head (same vocabulary and hidden size). Sizes: docs/kimi.md.
    """

    tokenizer_from: "ModelSpec"
    init_embeddings_from: "ModelSpec | None" = None
    hidden_size: PositiveInt = 64
    num_layers: PositiveInt = 4
    full_attention_every: PositiveInt = 4
    intermediate_size: PositiveInt = 128  # the dense MLP of the first_k_dense layers
    # KDA (linear attention)
    linear_num_heads: PositiveInt = 2
    linear_head_dim: PositiveInt = 16
    conv_kernel_size: PositiveInt = 4
    # MLA (full attention, NoPE in Kimi Linear)
    num_attention_heads: PositiveInt = 2
    kv_lora_rank: PositiveInt = 16
    q_lora_rank: PositiveInt | None = None
    qk_nope_head_dim: PositiveInt = 16
    qk_rope_head_dim: PositiveInt = 8
    v_head_dim: PositiveInt = 16
    # MoE
    num_experts: int = Field(4, ge=2)
    experts_per_token: PositiveInt = 2
    num_shared_experts: PositiveInt = 1
    moe_intermediate_size: PositiveInt = 32
    first_k_dense: int = Field(1, ge=0)
    routed_scaling_factor: PositiveFloat = 2.446
    seed: int = 0
    init_std: PositiveFloat = 0.02
    # Initial weight of the final RMSNorm, i.e. the initial logit scale. None: 0.1 when the
    # embeddings come from a teacher (else a random body + the teacher's embedding/head is a
    # saturated "repeat the last token" model whose reverse-KL gradient vanishes), 1.0 otherwise.
    final_norm_init: PositiveFloat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> "KimiSpec":
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"first_k_dense {self.first_k_dense} > num_layers {self.num_layers}")
        return self


class TransplantSpec(Strict):
    """A model given a new tokenizer (docs/transplant.md; model/transplant.py).

    The body of `base` is kept; its embedding matrix is replaced by one row per token of the new
    tokenizer: the mean of base's rows for that token's text as base's tokenizer splits it (the
    tied output head is the same matrix). The new tokenizer is `tokenizer` when given, else a
    byte-level BPE of `vocab_size` tokens trained on `corpus` (the built-in corpus when None).
    Built once and cached under the k3post cache, keyed by this spec.
    """

    base: "ModelSpec" = Field(description="the model whose body is kept (any source; may carry keep_layers); "
                                          "it must tie its input embedding and output head")
    tokenizer: str | None = Field(None, description="a Hugging Face tokenizer directory (a fast tokenizer: "
                                                    "byte-level, SentencePiece, WordPiece) to transplant onto; "
                                                    "None: train a new one")
    tokenizer_from: "ModelSpec | None" = Field(None, description="transplant onto this model's tokenizer (e.g. "
                                                                "a teacher's), instead of a directory or training one")
    vocab_size: PositiveInt = Field(12000, description="size of the trained tokenizer's vocabulary (256 byte "
                                                       "tokens, base's special tokens and the merges)")
    corpus: list[str] | None = Field(None, min_length=1, description="UTF-8 text files to train the tokenizer on; "
                                                                     "None: the built-in corpus")

    @model_validator(mode="after")
    def _train_or_given(self) -> "TransplantSpec":
        if self.tokenizer is not None and self.tokenizer_from is not None:
            raise ValueError("give tokenizer or tokenizer_from, not both")
        if self.tokenizer is not None or self.tokenizer_from is not None:
            unused = [k for k in ("vocab_size", "corpus") if k in self.model_fields_set]
            if unused:
                raise ValueError(f"{' and '.join(unused)} train a tokenizer; with tokenizer: given, leave "
                                 f"{'them' if len(unused) > 1 else 'it'} out")
        return self


SOURCES = ("builtin", "path", "gguf", "tiny", "kimi", "transplant")


class ModelSpec(Strict):
    """Where a model's weights come from: exactly one of `builtin`, `path`, `gguf`, `tiny`, `kimi`,
    `transplant`.

    `keep_layers` builds a layer-pruned model (a student initialised from a subset of the
    source model's decoder layers, in the given order). `transplant` gives another spec's model
    a new tokenizer (a student whose vocabulary differs from its teachers').
    """

    builtin: Literal["smollm2-135m-instruct"] | None = None
    path: str | None = Field(None, description="a Hugging Face model directory")
    gguf: str | None = Field(None, description="a GGUF file, converted once to a cached HF directory")
    tiny: TinyModelSpec | None = None
    kimi: KimiSpec | None = None
    transplant: TransplantSpec | None = Field(None, description="another spec's model with a new tokenizer, its "
                                                                "embeddings the means of the old ones")
    keep_layers: list[int] | None = Field(None, min_length=1)
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSpec":
        given = [k for k in SOURCES if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(SOURCES)} (got {given or 'none'})")
        if self.keep_layers is not None and len(set(self.keep_layers)) != len(self.keep_layers):
            raise ValueError("keep_layers has repeated layer indices")
        return self


KimiSpec.model_rebuild()  # resolve their forward references to ModelSpec
TransplantSpec.model_rebuild()
