"""Device memory of a learner rank, from the model's shape and the recipe's settings (pure maths).

Everything is bytes per rank; N = parameters, R = learner ranks, m = bytes of a master value
(4 for fp32 and bf16-mixed, 2 for pure bf16), c = bytes of a compute value (2 for bf16 and
bf16-mixed, 4 for fp32). The peak is what `torch.cuda.max_memory_allocated` reports (no CUDA
context, no allocator slack: the verdict adds those, k3post/plan/verdict.py).

State (all step long, model/training/fsdp.py's table):
    weights N·m/R + gradients N·m/R + AdamW's two moments 2·N·m/R      (16 bytes/param in bf16-mixed)
    LoRA (one unsharded rank): the frozen base N·c, and 16 bytes per adapter parameter (peft keeps
    adapters in fp32); an adapter has rank × (in + out) parameters per wrapped Linear.
FSDP2's gathered weights (sharded learner only), in the compute dtype:
    shard_unit model: the whole student, N·c, from the forward to the end of the backward;
    shard_unit block: the root's (embeddings, head) plus two blocks (one computing, one prefetched).

Saved activations, per token of a micro-batch (rows × sequence length), per decoder layer, for
hidden h, MLP width i, query heads a and key/value heads g of head dim d, from the tensors the
eager HF block keeps for its backward (bf16 unless said):
    RMSNorm ×2                     2 × (4h fp32 input + 2h normalised + 2h output)    = 16h
    queries after RoPE, keys, values   2ad + 2·2·(a or g)d   (with an attention mask — rows of
                                   different lengths — HF repeats the KV heads to a before SDPA,
                                   so keys/values are saved at a heads; without one, at g)
    attention output (o_proj's input is a view of it: SDPA writes [B, L, a, d])   2ad
    SwiGLU MLP                     gate 2i, SiLU(gate) 2i, up 2i, product 2i           = 8i
Compiled blocks (`train.compile`: inductor's partitioner recomputes pointwise ops in backward)
keep only what the matmuls and attention cannot recompute cheaply: the two residual-stream
inputs 2h + 2h, queries/keys/values and the attention output as above, and of the MLP gate,
up and down_proj's input 6i (the one matmul input that is not a cheap function of another).
A MoE layer's MLP term is (top_k + shared experts) × the same per-expert term at the expert
width, plus the router's fp32 scores 4E; KDA (linear attention) layers count their heads like
attention heads (an approximation: no Kimi Linear peak has been measured on a GPU yet).
Activation checkpointing keeps each block's input (2h per token per layer) and, in the
backward, one block's saved set and its gradients at once (2 × one layer's).
Outside the blocks: the final norm's saved set (8h eager, 2h compiled) and its output (2h).

The LM head is applied 1,024 positions at a time under checkpointing (model/scoring/logprobs.py), so
only one chunk of logits lives at once, during its backward: per position the bf16 logits 2V,
their fp32 copy 4V, and the fp32 gradient of logsumexp and of the gather 4V + 4V, then its bf16
cast 2V (16V eager); compiled, one fused pass reads the bf16 logits and writes the bf16
gradient through one fp32 buffer (2V + 4V). The full-vocabulary loss differentiates the whole
distribution of each completion token of a micro-batch (fp32 logits and log-softmax, 8V) and
holds the teachers' fp32 log-probabilities of the step's rows (4V per completion token).

The peak is the larger of two moments: the start of the backward (state, gathered weights,
every saved activation, one head chunk and, sharded, the root unit's unsharded gradients
root·c, which live until the root reduces last) and the end of a micro-batch's backward in the
sharded learner, where the largest unit's unsharded gradients (c per param: the whole model,
or the larger of a block and the root), their fp32 copy for the reduction and its
reduce-scattered output (4 + 4/R) exist at once - with a large vocabulary the root (embeddings
and head) is that unit, and this moment is the peak.

Samplers' copy: a sharded learner of one rank on a GPU, in a run with samplers, keeps the student
in the export dtype (the student's: 2 bytes a parameter for bf16, 4 for fp32) on its device between
syncs (FP8 payload buffers are not counted apart; a run whose weights go by `collective` never
builds the copy: the figure is then an over-estimate). A group of several ranks gathers bucket by
bucket and keeps none.
Reference (loss.reference.kind): none 0; copy: a second student, N·m/R sharded (its fp32 shard)
or N·c unsharded; grad_buffer: 64 MiB of swap scratch on the device and the reference's shard
N·m/R in pinned host memory per rank (the unsharded learner's host copy: N·c). With LoRA the
reference is the base model with the adapters off: no memory.
FP8 QAT: each fake-quantised Linear keeps its quantised weight (c per Linear parameter) from its
forward to its backward: all the blocks' Linear weights, or one block's under checkpointing.
Draft head (draft.kind: mtp, engine/learner/draft_trainer.py): its parameters (a copy of one block, the
2h→h projection and two norms) with their gradients and its own AdamW's two moments, 4·m each,
sharded like the student; and the last hidden states it keeps of each micro-batch's policy
forward through that micro-batch's backward (tokens × h × c). Its own training runs after the
student's backward has freed the student's activations (one block over the micro-batch and one
chunk of logits: less than the student's backward start, so not added).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3post.plan.shapes import ModelShape

GIB = 2**30
HEAD_CHUNK = 1024  # model/scoring/logprobs.py DEFAULT_CHUNK
SWAP_SCRATCH = 2**24 * 4  # engine/sharded/sharded_reference.py: 2^24 fp32 elements


@dataclass(frozen=True)
class LearnerSetup:
    """How one learner rank holds and trains the student (the recipe's keys, resolved)."""

    precision: str  # fp32 | bf16 | bf16-mixed (auto already resolved)
    sharded: bool  # FSDP2 (engine/sharded/learner_rank.py: uses_sharding)
    ranks: int
    micro_batch: int  # sequences per forward/backward
    seq_len: int  # tokens of each sequence: prompt + completion
    completion_len: int  # tokens the head scores per sequence
    shard_unit: str = "block"
    activation_checkpointing: bool = False
    compiled: bool = False
    reference: str = "none"
    qat: bool = False
    lora_rank: int = 0
    full_vocab: bool = False
    rows_per_step: int = 0  # rows of the step on this rank (the full-vocab teachers' log-probabilities)
    padded: bool = True  # rows of different lengths: an attention mask (GQA keys/values repeated)
    draft: bool = False  # an MTP draft head trained beside the student
    samplers_copy: int = 0  # bytes a parameter the samplers get (the student's dtype), in a GPU run with them


@dataclass
class Breakdown:
    """Bytes of each part of a rank's peak, and the pinned host memory it also takes."""

    parts: dict[str, float] = field(default_factory=dict)
    host_pinned: float = 0.0

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def master_bytes(precision: str) -> int:
    return 2 if precision == "bf16" else 4


def compute_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def state_bytes(shape: ModelShape, s: LearnerSetup) -> dict[str, float]:
    """Weights, gradients and AdamW moments of one rank (module docstring, "State")."""
    m, c = master_bytes(s.precision), compute_bytes(s.precision)
    if s.lora_rank:
        adapters = s.lora_rank * shape.lora_in_out  # fp32 (peft's autocast_adapter_dtype): 16 bytes each
        return {"weights": shape.params * c + adapters * 4, "gradients": adapters * 4, "optimizer": 2 * adapters * 4}
    share = shape.params / (s.ranks if s.sharded else 1)
    return {"weights": share * m, "gradients": share * m, "optimizer": 2 * share * m}


def gathered_bytes(shape: ModelShape, s: LearnerSetup) -> float:
    """FSDP2's unsharded compute weights held at the peak (0 for the unsharded learner)."""
    if not s.sharded:
        return 0.0
    c = compute_bytes(s.precision)
    if s.shard_unit == "model":
        return shape.params * c
    return (shape.root_params + 2 * shape.block_params) * c


def _attention_width(shape: ModelShape) -> int:
    return shape.heads * shape.head_dim


def _mlp_term(shape: ModelShape, per_width: int) -> float:
    """The MLP's saved bytes per token of one layer, averaged over dense and MoE layers."""
    dense = per_width * shape.intermediate
    if not shape.moe_experts:
        return dense
    moe = per_width * (shape.moe_top_k + shape.moe_shared) * shape.moe_intermediate + 4 * shape.moe_experts
    return (dense * (shape.layers - shape.moe_layers) + moe * shape.moe_layers) / shape.layers


def layer_bytes_per_token(shape: ModelShape, compiled: bool, padded: bool) -> float:
    """What one decoder layer saves for its backward, per token (module docstring)."""
    h, ad = shape.hidden, _attention_width(shape)
    kv = 4 * ad if padded else 4 * shape.kv_heads * shape.head_dim
    attention = 2 * ad + kv + 2 * ad
    if compiled:
        return 4 * h + attention + _mlp_term(shape, 6)
    return 16 * h + attention + _mlp_term(shape, 8)


def activation_bytes(shape: ModelShape, s: LearnerSetup) -> float:
    """The saved activations of one micro-batch at the start of its backward."""
    tokens = s.micro_batch * s.seq_len
    layer = layer_bytes_per_token(shape, s.compiled, s.padded)
    outside = (2 if s.compiled else 8) * shape.hidden + 2 * shape.hidden
    if s.activation_checkpointing:
        blocks = shape.layers * 2 * shape.hidden + 2 * layer
    else:
        blocks = shape.layers * layer
    return tokens * (blocks + outside)


def head_bytes(shape: ModelShape, s: LearnerSetup) -> float:
    """The LM head's transient at its backward: one chunk, or the full-vocabulary loss's logits."""
    completion = s.micro_batch * s.completion_len
    if s.full_vocab:
        return completion * 8 * shape.vocab + s.rows_per_step * s.completion_len * 4 * shape.vocab
    positions = min(HEAD_CHUNK, completion)
    return positions * (6 if s.compiled else 16) * shape.vocab


def reduction_bytes(shape: ModelShape, s: LearnerSetup) -> float:
    """The sharded learner's end-of-backward gradients of one unit, unsharded and reduced."""
    if not s.sharded:
        return 0.0
    unit = shape.params if s.shard_unit == "model" else max(shape.block_params, shape.root_params)
    return unit * (compute_bytes(s.precision) + 4 + 4 / s.ranks)


def reference_bytes(shape: ModelShape, s: LearnerSetup) -> tuple[float, float]:
    """(device, pinned host) bytes of the reference model."""
    if s.reference == "none" or s.lora_rank:
        return 0.0, 0.0
    m, c = master_bytes(s.precision), compute_bytes(s.precision)
    share = shape.params * m / s.ranks if s.sharded else shape.params * c
    if s.reference == "copy":
        return share, 0.0
    return (SWAP_SCRATCH if s.sharded else 0.0), share


def qat_bytes(shape: ModelShape, s: LearnerSetup) -> float:
    """FP8 QAT's fake-quantised Linear weights, kept from forward to backward."""
    if not s.qat:
        return 0.0
    linear = shape.linear_params / shape.layers if s.activation_checkpointing else shape.linear_params
    return linear * compute_bytes(s.precision)


def draft_bytes(shape: ModelShape, s: LearnerSetup) -> float:
    """The draft head's state and the hidden states it keeps of a micro-batch (module docstring)."""
    if not s.draft:
        return 0.0
    params = shape.block_params + 2 * shape.hidden * shape.hidden + 2 * shape.hidden
    state = 4 * params * master_bytes(s.precision) / (s.ranks if s.sharded else 1)
    return state + s.micro_batch * s.seq_len * shape.hidden * compute_bytes(s.precision)


def export_bytes(shape: ModelShape, s: LearnerSetup) -> float:
    """A sharded learner of one rank keeps the samplers' copy of the student on its device, in
    the export dtype, between syncs (engine/sharded/sharded_learner.py: `_device_weights`)."""
    return shape.params * s.samplers_copy if s.sharded and s.ranks == 1 else 0.0


def learner_peak(shape: ModelShape, s: LearnerSetup) -> Breakdown:
    """A learner rank's peak device memory, part by part (module docstring)."""
    out = Breakdown(dict(state_bytes(shape, s)))
    out.parts["gathered weights"] = gathered_bytes(shape, s)
    head_grads = shape.root_params * compute_bytes(s.precision) if s.sharded else 0.0
    backward_start = activation_bytes(shape, s) + head_bytes(shape, s) + head_grads
    backward_end = reduction_bytes(shape, s)
    if backward_start >= backward_end:
        out.parts["activations"] = activation_bytes(shape, s)
        out.parts["LM head"] = head_bytes(shape, s) + head_grads
    else:
        out.parts["gradient reduction"] = backward_end
    device, host = reference_bytes(shape, s)
    out.parts["reference"] = device
    out.host_pinned = host
    out.parts["FP8 QAT"] = qat_bytes(shape, s)
    out.parts["draft head"] = draft_bytes(shape, s)
    out.parts["samplers' copy"] = export_bytes(shape, s)
    return out
