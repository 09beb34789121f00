"""A learner rank: one process of an FSDP2 learner group (engine/learner.py is one process).

Every public method is called on every rank, with the same arguments (the driver hands each
rank the same batch; Ray's object store shares it); rank 0's return value is the group's.
The N ranks compute the one-process update:

- the step's micro-batches are dealt round-robin (rank r takes micro-batches r, r+N, ...);
  every rank runs the same number of forward/backward passes (FSDP's all-gathers and
  reduce-scatters are collectives), a rank short of work repeating the step's first
  micro-batch with its loss multiplied by 0 — the same graph, so the same collectives, and an
  exactly zero gradient (a zero-mask micro-batch would drop the LM head from the graph);
- losses are divided by the *global* token count (all-reduced), and the ranks' gradients are
  summed, not averaged (model/fsdp.py sets the divide factor to 1);
- the grad norm is the global one (DTensor), and metrics are all-reduced (sums, weighted
  means, maxima) so rank 0 reports the group's figures; a non-finite loss or norm skips the
  update on every rank alike.

Options: precision and activation checkpointing (LearnerSpec), FP8 QAT (prepared before
sharding), the grad-buffer or copy reference (engine/sharded_reference.py), checkpoints that
reshard (engine/sharded_checkpoint.py). LoRA is refused at load. MoE students train, but
their routing-bias updates are refused (each rank would move the replicated biases from its
own routing counts) and their load metrics are not logged.
"""

from __future__ import annotations

import json
import math
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import torch

from k3post.algo.objectives import ReferenceKL
from k3post.algo.policy_loss import importance_ratio_stats
from k3post.algo.schedule import warmup_cosine_factor
from k3post.config.errors import UserError
from k3post.config.learner_schema import LearnerSpec
from k3post.engine.common import set_threads
from k3post.engine.rank import RankSpec, all_reduce_floats, init_group
from k3post.engine.sft_batch import sft_batch
from k3post.engine.sharded_checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from k3post.engine.sharded_reference import ShardedCopyRef, ShardedGradBufferRef
from k3post.engine.sharded_sync import ShardedBroadcastSender
from k3post.model.fsdp import clip_grad_norm, master_dtype, resolve_precision, shard_model
from k3post.model.logprobs import completion_full_logprobs, completion_logprobs
from k3post.model.qat import prepare_fp8_qat, set_fake_quant
from k3post.model.sharded_load import load_sharded_model
from k3post.model.sharded_weights import gathered_state
from k3post.types import Prompt, TrainBatch

TRAINER_STATE = "trainer_state.pt"
RUN_STATE = "run_state.json"


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


def _policy_outputs(model, mb: TrainBatch, pad_id: int, temperature: float, full: bool):
    """The student's logprobs of the completion tokens and, if asked, its full distributions
    (one call through the FSDP root: the head is gathered once for both)."""
    lp_BT = completion_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id, temperature)
    full_BTV = (completion_full_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                         temperature) if full else None)
    return lp_BT, full_BTV


class ShardedLearner(ShardedBroadcastSender):
    def __init__(self, config, rank: RankSpec, spec: LearnerSpec | None = None):
        check_shardable(config)
        set_threads(config.num_threads)
        init_group(rank)
        torch.manual_seed(config.seed)
        spec = spec or LearnerSpec()
        self.config, self.rank, self.spec, self.optim_spec = config, rank, spec, config.optim
        self.device = rank.device
        self.precision = resolve_precision(spec.precision, str(self.device), config.student.dtype)
        self.qat_layers: list[str] = []
        shard = partial(shard_model, precision=self.precision, activation_checkpointing=spec.activation_checkpointing)
        self.root, self.tokenizer = load_sharded_model(config.student, master_dtype(self.precision), self.device,
                                                       rank.rank, rank.world_size, self._prepare, shard)
        self.model = self.root.model  # the HF model (its parameters are the shards)
        self.objective = config.objective
        self.reference_kl = ReferenceKL(config.reference.kl_coef, config.reference.estimator)
        self.temperature = config.sampling_temperature
        self.params = [p for p in self.root.parameters() if p.requires_grad]
        optim = config.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: warmup_cosine_factor(step, optim.warmup_steps, config.total_steps, optim.min_lr_ratio))
        self.reference = self._make_reference(config, shard)
        self.steps_done = 0

    def _prepare(self, model) -> None:
        if self.config.qat.enabled:
            self.qat_layers = prepare_fp8_qat(model)

    def _make_reference(self, config, shard):
        ref = config.reference
        if ref.kind == "none" and ref.kl_coef == 0:
            return None
        if ref.kind == "copy":
            copy, _ = load_sharded_model(config.student, master_dtype(self.precision), self.device, self.rank.rank,
                                         self.rank.world_size, lambda m: None, shard)
            return ShardedCopyRef(copy, self._score)
        return ShardedGradBufferRef(self.root, self._score)

    def _score(self, root, mb: TrainBatch) -> torch.Tensor:
        return root(completion_logprobs, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT,
                    self.tokenizer.pad_token_id, self.temperature)

    def _work(self, batch: TrainBatch) -> list[tuple[TrainBatch, float]]:
        mbs = batch.micro_batches(self.optim_spec.micro_batch_size)
        return [(mb.to(self.device), w) for mb, w in rank_micro_batches(mbs, self.rank.rank, self.rank.world_size)]

    def _update_fake_quant(self) -> None:
        if self.qat_layers:
            set_fake_quant(self.model, self.steps_done >= self.config.qat.fake_quant_after_n_steps)

    def accumulate_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over this rank's micro-batches into the sharded `.grad`; returns
        the group's loss and diagnostics."""
        self._update_fake_quant()
        self.root.train()
        work = self._work(batch)
        local_tokens = sum(float(mb.loss_mask_BT.sum()) for mb, w in work if w)
        num_tokens = max(all_reduce_floats([local_tokens])[0], 1.0)
        pad_id = self.tokenizer.pad_token_id
        ref_lps = (self.reference.logprobs([mb for mb, _ in work], pad_id, self.temperature)
                   if self.reference else None)
        sums = {"loss": 0.0, "ref_kl": 0.0, "ratio_mean": 0.0, "logprob_abs_diff": 0.0}
        ratio_max, full = 0.0, self.objective.needs_student_distributions
        for i, (mb, weight) in enumerate(work):
            student_lp_BT, student_full_BTV = self.root(_policy_outputs, mb, pad_id, self.temperature, full)
            loss = self.objective.loss(mb, student_lp_BT, student_full_BTV, num_tokens)
            if ref_lps is not None:
                sums["ref_kl"] += weight * ReferenceKL.logged(student_lp_BT, ref_lps[i], mb.loss_mask_BT, num_tokens)
                if self.reference_kl.coef > 0:
                    loss = loss + self.reference_kl.loss(student_lp_BT, ref_lps[i], mb.loss_mask_BT, num_tokens)
            (loss * weight).backward()  # weight 0: the same collectives, an exactly zero gradient
            if weight:
                sums["loss"] += float(loss.detach())
                share = float(mb.loss_mask_BT.sum()) / num_tokens
                stats = importance_ratio_stats(student_lp_BT.detach(), mb.sampler_logprobs_BT, mb.loss_mask_BT)
                sums["ratio_mean"] += share * stats["ratio_mean"]
                sums["logprob_abs_diff"] += share * stats["logprob_abs_diff"]
                ratio_max = max(ratio_max, stats["ratio_max"])
        self.root.eval()
        keys = list(sums)
        totals = dict(zip(keys, all_reduce_floats([sums[k] for k in keys])))
        totals["ratio_max"] = all_reduce_floats([ratio_max], op="max")[0]
        return self._step_metrics(totals, num_tokens, ref_lps is not None)

    def _step_metrics(self, totals: dict[str, float], num_tokens: float, has_ref: bool) -> dict[str, float]:
        metrics = {"train/loss": totals["loss"], "train/tokens": num_tokens}
        if has_ref:
            metrics["train/ref_kl"] = totals["ref_kl"]
        if self.objective.compares_with_sampler:
            for key in ("ratio_mean", "logprob_abs_diff", "ratio_max"):
                metrics[f"train/{key}"] = totals[key]
        if self.qat_layers:
            metrics["train/fake_quant"] = float(self.steps_done >= self.config.qat.fake_quant_after_n_steps)
        return metrics

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """The group's gradient of the whole batch, global-norm clip, step (skipped alike on
        every rank when the loss or the norm is not finite)."""
        metrics = self.accumulate_gradients(batch)
        grad_norm = clip_grad_norm(self.params, self.optim_spec.grad_clip)
        skipped = not (math.isfinite(grad_norm) and math.isfinite(metrics["train/loss"]))
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # the grad-buffer reference lives in them
        if self.reference is not None:
            self.reference.prefetch()  # next step's reference shards, while the rest of the run goes on
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.steps_done += 1
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped": float(skipped)})
        return metrics

    def sft_step(self, examples: list[Prompt]) -> dict[str, float]:
        return self.train_step(sft_batch(self.tokenizer, examples, self.config.max_completion_tokens))

    @torch.no_grad()
    def sft_eval(self, examples: list[Prompt]) -> dict[str, float]:
        """Token-mean NLL of held-out replies over the group (every rank runs the same number
        of forwards: the gathers are collective)."""
        batch = sft_batch(self.tokenizer, examples, self.config.max_completion_tokens)
        self._update_fake_quant()
        total, count = 0.0, 0.0
        for mb, weight in self._work(batch):
            lp = self.root(completion_logprobs, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT,
                           self.tokenizer.pad_token_id)
            total += weight * float(-(lp * mb.loss_mask_BT).sum())
            count += weight * float(mb.loss_mask_BT.sum())
        self.root.reshard()
        total, count = all_reduce_floats([total, count])
        return {"eval/nll": total / max(count, 1.0), "eval/tokens": count}

    def export_dtype(self) -> torch.dtype:
        """What samplers and HF exports get: the student's dtype (bf16 from fp32 masters)."""
        return getattr(torch, self.config.student.dtype)

    def weights(self) -> dict[str, np.ndarray | torch.Tensor]:
        """The full weights on rank 0 ({} on the others), gathered bucket by bucket into host
        memory (numpy where numpy has the dtype, for Ray's zero-copy object store)."""
        state = gathered_state(self.model, self.export_dtype(), to_host=True,
                               bucket_bytes=self.spec.weight_bucket_mb * 2**20)
        return {k: v if v.dtype == torch.bfloat16 else v.numpy() for k, v in state.items()}

    def save_checkpoint(self, directory: str, run_state: dict) -> str:
        """Sharded model + optimizer (DCP), the HF export, scheduler/RNG/run state; atomic."""
        def rank0_files(tmp: Path) -> None:
            self.model.config.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            torch.save({"scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                        "steps_done": self.steps_done}, tmp / TRAINER_STATE)
            (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=1))

        self.root.reshard()
        save_sharded_checkpoint(Path(directory), self.root, self.optimizer, rank0_files, self.export_dtype())
        return directory

    def load_checkpoint(self, directory: str) -> dict:
        """Restore shards (from a group of any size), optimizer, scheduler, RNG; returns run_state."""
        path = Path(directory)
        self.root.reshard()
        load_sharded_checkpoint(path, self.root, self.optimizer)
        if self.reference is not None:
            self.reference.prefetched = False  # the buffers were zeroed: copy the reference again
        trainer = torch.load(path / TRAINER_STATE, weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        torch.set_rng_state(trainer["torch_rng"])
        self.steps_done = trainer["steps_done"]
        return json.loads((path / RUN_STATE).read_text())
