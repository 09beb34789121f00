"""The recipe schema. Defaults live here and nowhere else.

Every model is frozen and forbids unknown keys, so a typo in a recipe is an error at load
time, not a silently ignored setting. Cross-references (a data source naming its teacher)
are checked by `DistillRecipe` itself.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, model_validator

BUILTIN_MODELS = ("smollm2-135m-instruct",)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


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


class ModelSpec(Strict):
    """Where a model's weights come from: exactly one of `builtin`, `path`, `gguf`, `tiny`, `kimi`.

    `keep_layers` builds a layer-pruned model (a student initialised from a subset of the
    source model's decoder layers, in the given order).
    """

    builtin: Literal["smollm2-135m-instruct"] | None = None
    path: str | None = Field(None, description="a Hugging Face model directory")
    gguf: str | None = Field(None, description="a GGUF file, converted once to a cached HF directory")
    tiny: TinyModelSpec | None = None
    kimi: KimiSpec | None = None
    keep_layers: list[int] | None = Field(None, min_length=1)
    dtype: Literal["float32", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _exactly_one_source(self) -> "ModelSpec":
        given = [k for k in ("builtin", "path", "gguf", "tiny", "kimi") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of builtin, path, gguf, tiny, kimi (got {given or 'none'})")
        if self.keep_layers is not None and len(set(self.keep_layers)) != len(self.keep_layers):
            raise ValueError("keep_layers has repeated layer indices")
        return self


KimiSpec.model_rebuild()  # resolve its forward references to ModelSpec


class ResourceSpec(Strict):
    """Ray resources of one actor group: `replicas` actors, each with these CPUs/GPUs."""

    replicas: PositiveInt = 1
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    # torch intra-op threads per actor; None = every core of the node. Samplers and the learner
    # run alone in their phase and should use them all; teacher groups score at the same time,
    # so on a small machine give each a share (the quickstart gives each teacher 1 of 2 cores).
    threads: PositiveInt | None = None


class TeacherSpec(Strict):
    """One teacher: recipes/teachers/<name>.yaml (`kind: teacher`)."""

    kind: Literal["teacher"] = "teacher"
    description: str = ""
    model: ModelSpec
    engine: Literal["hf"] = "hf"
    # A teacher may see the prompt with its own system prompt; it always scores the
    # student's completion tokens as they are.
    system_prompt: str | None = None
    # Teacher logprobs are taken at temperature 1 by default: the reverse KL is to the
    # teacher's actual distribution (slime PR #2085 was a teacher scored at temperature 0).
    temperature: PositiveFloat = 1.0
    resources: ResourceSpec = ResourceSpec()


class SourceSpec(Strict):
    """A prompt source and the teacher its prompts are routed to."""

    name: str = Field(min_length=1)
    prompts: str = Field(min_length=1, description="builtin:<name> or a .jsonl/.json/.parquet path")
    teacher: str
    weight: PositiveFloat = 1.0
    heldout: int = Field(16, ge=0, description="rows kept out of training for evaluation")


class DataSpec(Strict):
    sources: list[SourceSpec] = Field(min_length=1)
    prompts_per_step: PositiveInt = 8


class SamplingSpec(Strict):
    max_new_tokens: PositiveInt = 64
    temperature: PositiveFloat = 1.0
    top_p: float = Field(1.0, gt=0, le=1)


class ReferenceSpec(Strict):
    """A KL-to-reference term in the loss, and where the reference weights live.

    grad_buffer: the initial weights held on the host and swapped through the idle .grad
    buffers each step (no second model in device memory; docs/learner.md). copy: a second model
    (the baseline the trick is measured against). With LoRA the reference is always the base
    model with the adapters disabled.
    """

    kind: Literal["none", "grad_buffer", "copy"] = "none"
    kl_coef: float = Field(0.0, ge=0)
    estimator: Literal["k1", "k2", "k3"] = "k3"


class LoraSpec(Strict):
    rank: int = Field(0, ge=0, description="0 = full fine-tuning")
    alpha: PositiveFloat = 16.0
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class QatSpec(Strict):
    """FP8 quantization-aware training (torchao): fake-quantized Linear layers (per-row e4m3
    weights and per-token e4m3 activations), lm_head and layers the FP8 kernels reject skipped."""

    enabled: bool = False
    fake_quant_after_n_steps: int = Field(0, ge=0, description="train in full precision for the first N steps")


class LossSpec(Strict):
    """The OPD objective.

    sampled_token: advantage A_t = -kl_coef * (log mu(y_t) - log pi_T(y_t)) with an
    importance-sampled policy-gradient loss (tinker-cookbook). full_vocab: the exact reverse
    KL over the whole vocabulary, differentiated directly (needs the teachers' full logits).
    """

    kind: Literal["sampled_token", "full_vocab"] = "sampled_token"
    kl_coef: PositiveFloat = 1.0
    kl_discount: float = Field(0.0, ge=0, le=1)
    reference: ReferenceSpec = ReferenceSpec()


class OptimSpec(Strict):
    lr: PositiveFloat = 5e-5
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: PositiveFloat = 1.0
    micro_batch_size: PositiveInt = 4


class TrainSpec(Strict):
    steps: PositiveInt = 40
    seed: int = 0
    eval_every: int = Field(10, ge=0, description="0 = only at the start and the end")
    checkpoint_every: int = Field(10, ge=0, description="0 = only at the end")
    keep_checkpoints: PositiveInt = 2
    # A non-finite loss or gradient skips the update (train/skipped = 1); this many skipped
    # steps in a row stop the run, before any checkpoint of that step is written.
    max_skipped_steps: int = Field(3, ge=0, description="consecutive skipped updates that stop the run; 0 = never")
    # torch.compile the learner's decoder blocks. On a GPU it fuses FP8 fake quantization: an
    # H200 QAT step went from 3.6x to 0.96x of a bf16 step (docs/benchmarks.md). Slow to
    # warm up on a CPU.
    compile: bool = False


class EvalSpec(Strict):
    """Held-out evaluation: exact reverse KL on the student's samples, forward KL on the teacher's."""

    prompts_per_source: PositiveInt = 8
    max_new_tokens: PositiveInt = 48
    temperature: PositiveFloat = 1.0
    print_samples: int = Field(3, ge=0)


class ResourcesSpec(Strict):
    samplers: ResourceSpec = ResourceSpec()
    learner: ResourceSpec = ResourceSpec()

    @model_validator(mode="after")
    def _one_learner(self) -> "ResourcesSpec":
        if self.learner.replicas != 1:
            raise ValueError("resources.learner.replicas must be 1 (one learner actor)")
        return self


class RaySpec(Strict):
    """How `k3post run` gets a Ray cluster: join RAY_ADDRESS / `address`, or start a local one."""

    address: str | None = None
    num_cpus: PositiveInt | None = None
    object_store_mb: PositiveInt | None = 1024
    in_process: bool = Field(False, description="run every engine in this process, without Ray")


class DistillRecipe(Strict):
    kind: Literal["distill"]
    description: str = ""
    student: ModelSpec
    teachers: dict[str, TeacherSpec] = Field(min_length=1)
    data: DataSpec
    sampling: SamplingSpec = SamplingSpec()
    loss: LossSpec = LossSpec()
    optim: OptimSpec = OptimSpec()
    lora: LoraSpec = LoraSpec()
    qat: QatSpec = QatSpec()
    train: TrainSpec = TrainSpec()
    eval: EvalSpec = EvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    ray: RaySpec = RaySpec()

    @model_validator(mode="after")
    def _sources_name_known_teachers(self) -> "DistillRecipe":
        names = [s.name for s in self.data.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources: source names must be unique (got {names})")
        for i, source in enumerate(self.data.sources):
            if source.teacher not in self.teachers:
                raise ValueError(
                    f"data.sources[{i}].teacher: '{source.teacher}' is not a teacher of this recipe "
                    f"(teachers: {', '.join(sorted(self.teachers))})"
                )
        return self


class SftSourceSpec(Strict):
    """SFT examples: rows with a final assistant message or a completion field."""

    name: str = Field(min_length=1)
    examples: str = Field(min_length=1, description="builtin:<name> or a .jsonl/.json/.parquet path")
    completion_field: str = "completion"
    weight: PositiveFloat = 1.0
    heldout: int = Field(32, ge=0, description="rows kept out of training for the held-out NLL")


class SftDataSpec(Strict):
    sources: list[SftSourceSpec] = Field(min_length=1)
    examples_per_step: PositiveInt = 8
    max_completion_tokens: PositiveInt = 256


class SftEvalSpec(Strict):
    examples_per_source: PositiveInt = 32


class SftRecipe(Strict):
    """Supervised fine-tuning (optionally with FP8 QAT and LoRA): loss on the reply tokens only."""

    kind: Literal["sft"]
    description: str = ""
    model: ModelSpec
    data: SftDataSpec
    optim: OptimSpec = OptimSpec()
    lora: LoraSpec = LoraSpec()
    qat: QatSpec = QatSpec()
    train: TrainSpec = TrainSpec()
    eval: SftEvalSpec = SftEvalSpec()
    resources: ResourcesSpec = ResourcesSpec()
    ray: RaySpec = RaySpec()


RECIPE_KINDS: dict[str, type[Strict]] = {"distill": DistillRecipe, "sft": SftRecipe, "teacher": TeacherSpec}
