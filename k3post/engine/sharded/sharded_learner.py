"""A learner rank: one process of an FSDP2 learner group (engine/learner/learner.py is one process;
the training step both run is engine/learner/learner_base.py's, over the hooks defined here).

Every public method is called on every rank, with the same arguments (the driver hands each
rank the same batch; Ray's object store shares it); rank 0's return value is the group's.
The N ranks compute the one-process update:

- the step's micro-batches are dealt round-robin (rank r takes micro-batches r, r+N, ...);
  every rank runs the same number of forward/backward passes (FSDP's all-gathers and
  reduce-scatters are collectives), a rank short of work repeating the step's first
  micro-batch with its loss multiplied by 0 — the same graph, so the same collectives, and an
  exactly zero gradient (a zero-mask micro-batch would drop the LM head from the graph);
- losses are divided by the *global* token count (read from the whole batch, which every rank
  has), and the ranks' gradients are summed, not averaged (model/training/fsdp.py sets the divide
  factor to 1);
- the grad norm is the global one (DTensor), and metrics are all-reduced (sums, weighted
  means, maxima) so rank 0 reports the group's figures; a non-finite loss or norm skips the
  update on every rank alike.

Options: precision and activation checkpointing (LearnerSpec), FP8 QAT (prepared before
sharding), the grad-buffer or copy reference (engine/sharded/sharded_reference.py), checkpoints that
reshard (engine/learner/sharded_checkpoint.py), an MTP draft head sharded like a block
(engine/sharded/sharded_draft.py). LoRA is refused at load. MoE students train, but
their routing-bias updates are refused (each rank would move the replicated biases from its
own routing counts) and their load metrics are not logged.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch

from k3post.config.errors import UserError
from k3post.config.learner_schema import LearnerSpec
from k3post.engine.common import set_threads
from k3post.engine.learner.draft_trainer import WEIGHT_PREFIX
from k3post.engine.learner.learner_base import LearnerStep
from k3post.engine.sharded.rank import RankSpec, all_reduce_floats, init_group
from k3post.engine.learner.sharded_checkpoint import load_state, save_sharded_checkpoint
from k3post.engine.sharded.sharded_draft import ShardedDraftTrainer, copy_last_block
from k3post.engine.sharded.sharded_reference import ShardedCopyRef, ShardedGradBufferRef
from k3post.engine.sharded.sharded_sync import ShardedBroadcastSender
from k3post.model.training.fsdp import ShardLocalAdamW, clip_grad_norm, master_dtype, resolve_precision, shard_model
from k3post.model.scoring.prefix_scoring import grouped_logprobs
from k3post.model.quant.qat import prepare_fp8_qat
from k3post.model.training.sharded_load import load_sharded_model
from k3post.model.training.sharded_weights import gathered_state, refill_full_state
from k3post.types import TrainBatch


def rank_micro_batches(micro_batches: list[TrainBatch], rank: int, world_size: int
                       ) -> list[tuple[TrainBatch, float]]:
    """This rank's (micro-batch, weight) pairs: its round-robin share at weight 1, then the
    step's first micro-batch at weight 0 until every rank has ceil(M / N) of them."""
    mine = [(mb, 1.0) for mb in micro_batches[rank::world_size]]
    count = -(-len(micro_batches) // world_size)
    return mine + [(micro_batches[0], 0.0)] * (count - len(mine))


def check_shardable(config) -> None:
    if config.lora.rank > 0:
        raise UserError("lora.rank > 0 with a sharded learner (learner replicas > 1 or learner.precision bf16-mixed): "
                        "LoRA is not supported under FSDP yet; use one learner rank with precision bf16 or fp32, "
                        "or full fine-tuning")
    if config.moe.bias_update != "none":
        raise UserError(f"moe.bias_update: {config.moe.bias_update} with a sharded learner: routing-bias updates "
                        f"need the group's routing counts, which are not all-reduced yet; use bias_update: none")


class ShardedLearner(LearnerStep, ShardedBroadcastSender):
    """One rank of an FSDP2 learner group; the step is engine/learner/learner_base.py's, over this
    rank's hooks."""

    adamw = ShardLocalAdamW

    def __init__(self, config, rank: RankSpec, spec: LearnerSpec | None = None):
        check_shardable(config)
        set_threads(config.num_threads)
        init_group(rank)
        torch.manual_seed(config.seed)
        spec = spec or LearnerSpec()
        self.config, self.rank, self.spec = config, rank, spec
        self.device = rank.device
        self.precision = resolve_precision(spec.precision, str(self.device), config.student.dtype)
        self.qat_layers: list[str] = []
        self._draft_block = None  # the head's block, copied from the student before sharding
        shard = partial(shard_model, precision=self.precision, activation_checkpointing=spec.activation_checkpointing,
                        compile_blocks=config.compile, unit=spec.shard_unit)
        self.root, self.tokenizer = load_sharded_model(config.student, master_dtype(self.precision), self.device,
                                                       rank.rank, rank.world_size, self._prepare, shard)
        self.model = self.root.model  # the HF model (its parameters are the shards)
        self._init_step([p for p in self.root.parameters() if p.requires_grad])
        self.reference = self._make_reference(config, shard)
        if config.draft.kind == "mtp":
            self.draft = ShardedDraftTrainer(self.model, self._draft_block, config.draft, self.temperature,
                                             config.seed, self.precision, self.export_dtype(), self._all_reduce)
            self._draft_block = None

    def _prepare(self, model) -> None:
        if self.config.qat.enabled:
            self.qat_layers = prepare_fp8_qat(model)
        if self.config.draft.kind == "mtp":  # as the one-process head: a copy of the (QAT-prepared) last block
            self._draft_block = copy_last_block(model)

    def _make_reference(self, config, shard):
        ref = config.reference
        if ref.kind == "none" and ref.kl_coef == 0:
            return None
        if ref.kind == "copy":  # under QAT prepared like the learner's model (docs/learner.md)
            prepare = prepare_fp8_qat if config.qat.enabled else (lambda m: None)
            copy, _ = load_sharded_model(config.student, master_dtype(self.precision), self.device, self.rank.rank,
                                         self.rank.world_size, prepare, shard)
            return ShardedCopyRef(copy, self._score_reference)
        return ShardedGradBufferRef(self.root, self._score_reference)

    def _score_reference(self, root, mb: TrainBatch) -> torch.Tensor:
        """The reference's logprobs (no gradients): each distinct prompt of the micro-batch encoded
        once (model/scoring/prefix_scoring.py), inside the root's forward."""
        return root(grouped_logprobs, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT,
                    self.tokenizer.pad_token_id, self.temperature, compiled=self.config.compile)

    # -- the step's hooks (engine/learner/learner_base.py) --

    def _work(self, batch: TrainBatch) -> list[tuple[TrainBatch, float]]:
        mbs = batch.micro_batches(self.optim_spec.micro_batch_size)
        return [(mb.to(self.device), w) for mb, w in rank_micro_batches(mbs, self.rank.rank, self.rank.world_size)]

    def _run(self, fn, *args):
        """`fn(hf_model, *args)` inside the FSDP root's forward (where the root group is gathered)."""
        return self.root(fn, *args)

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return all_reduce_floats(values, op)

    def _clip_grad_norm(self) -> float:
        return clip_grad_norm(self.params, self.optim_spec.grad_clip)

    def _after_forwards(self) -> None:
        self.root.reshard()  # no backward follows to reshard the root's gathered parameters

    def _between_steps(self) -> None:
        if self.reference is not None:
            self.reference.prefetch()  # next step's reference shards, while the rest of the run goes on

    # -- weights and checkpoints --

    def export_dtype(self) -> torch.dtype:
        """What samplers and HF exports get: the student's dtype (bf16 from fp32 masters)."""
        return getattr(torch, self.config.student.dtype)

    def full_weights(self) -> dict[str, np.ndarray | torch.Tensor]:
        """The full weights on rank 0 ({} on the others), gathered bucket by bucket into host
        memory (numpy where numpy has the dtype, for Ray's zero-copy object store); with
        `draft.speculate`, the draft head's too, under `mtp.` names.

        One rank on a GPU holds every shard whole: its weights stay on the GPU instead, in
        export buffers refilled in place at each sync (`_device_weights`)."""
        if self.device.type == "cuda" and self.rank.world_size == 1:
            return self._device_weights()
        state = {}
        for prefix, module in self._weight_sources():
            gathered = gathered_state(module, self.export_dtype(), to_host=True,
                                      bucket_bytes=self.spec.weight_bucket_mb * 2**20)
            state.update({prefix + k: v for k, v in gathered.items()})
        return {k: v if v.dtype == torch.bfloat16 else v.numpy() for k, v in state.items()}

    def _device_weights(self) -> dict[str, torch.Tensor]:
        """The export dtype's copy of every weight, on this rank's GPU (model/training/sharded_weights.py:
        refill_full_state). Samplers beside the learner then take device tensors: in this process
        they copy them device to device, in another they map them under CUDA IPC. Host copies
        would cross as pickled bytes and back, 15× slower a GB (docs/benchmarks.md, vllm-gpu).
        It costs one copy of the student in the export dtype, kept between syncs (k3post/plan/memory.py)."""
        buffers = self.__dict__.setdefault("_export", {})
        for prefix, module in self._weight_sources():
            refill_full_state(module, buffers, self.export_dtype(), prefix)
        return dict(buffers)

    def _weight_sources(self) -> list[tuple[str, torch.nn.Module]]:
        """What the samplers get, (name prefix, sharded module): the student, and the draft head
        when the samplers draft with it."""
        if self.draft is not None and self.config.draft.speculate is not None:
            return [("", self.model), (WEIGHT_PREFIX, self.draft.head)]
        return [("", self.model)]

    def save_checkpoint(self, directory: str, run_state: dict) -> str:
        """Sharded model + optimizer (DCP), the HF export, scheduler/RNG/run state; atomic."""
        def rank0_files(tmp: Path) -> None:
            self.model.config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            self._write_trainer_state(tmp, run_state)

        self.root.reshard()
        save_sharded_checkpoint(Path(directory), self.model, self.optimizer, rank0_files, self.export_dtype(),
                                write_all=self.draft.save if self.draft is not None else None)
        return directory

    def load_checkpoint(self, directory: str) -> dict:
        """Restore shards (written by a group of any size, or by the one-process learner),
        optimizer, scheduler, RNG; returns run_state."""
        path = Path(directory)
        self.root.reshard()
        load_state(path, self.model, self.optimizer, distributed=True)
        if self.draft is not None:
            self.draft.load(path)
        if self.reference is not None:
            self.reference.prefetched = False  # the buffers were zeroed: copy the reference again
        return self._read_trainer_state(path)[1]
