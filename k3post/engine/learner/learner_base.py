"""One learner step, shared by the one-process `Learner` and the FSDP2 `ShardedLearner` ranks.

A step is: reference logprobs of every micro-batch (before any backward: the grad-buffer
reference lives in the gradient buffers), then per micro-batch the objective's loss plus the
KL-to-reference term, divided by the step's *global* token count, and its backward; then the
clipped grad norm, the optimizer step (skipped when the loss or the norm is not finite), the
scheduler step. Dividing by the global count makes the accumulated gradient exactly that of the
token-mean loss over the whole batch, whatever the micro-batch size (TRL #4719) and however
the micro-batches are spread over ranks. Every rank is handed the whole batch, so the global
count is read from it, with no collective.

What differs between one process and a rank of a group is a few hooks:

| hook               | one process (`Learner`)       | a rank of N (`ShardedLearner`)                   |
|--------------------|-------------------------------|--------------------------------------------------|
| `_work`            | every micro-batch, weight 1   | its round-robin share (+ weight-0 padding)       |
| `_run(fn, ...)`    | `fn(self.model, ...)`         | through the FSDP root (gathers the root group)   |
| `_all_reduce`      | identity                      | sum / max over the group                         |
| `_clip_grad_norm`  | `clip_grad_norm_`             | the global norm of the sharded (DTensor) grads   |
| `adamw` (class)    | `torch.optim.AdamW`           | `ShardLocalAdamW`: the update on local shards    |
| `_after_forwards`  | nothing                       | reshard the root after no-grad forwards          |
| `_between_steps`   | nothing                       | start copying the next step's reference shards   |

A micro-batch of weight 0 runs forward and backward (the same collectives on every rank) with
its loss multiplied by 0, and counts in no metric. With weight 1 the loss is used as it is, so
the one-process step runs exactly the operations it always ran, in the same order.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from k3post.algo.aggregate import token_sum_normalized
from k3post.algo.objectives import ReferenceKL
from k3post.algo.drift import is_correction_factor, mismatch_stats
from k3post.algo.schedule import warmup_cosine_factor
from k3post.engine.learner.sft_batch import sft_batch
from k3post.model.quant.fp8_sync import fp8_payload
from k3post.model.scoring.logprobs import completion_logprobs, completion_logprobs_and_full
from k3post.model.quant.qat import set_fake_quant
from k3post.track.model_card import CARD_FILE
from k3post.types import Prompt, TrainBatch, tensor_bytes

TRAINER_STATE = "trainer_state.pt"
RUN_STATE = "run_state.json"
# Token-weighted means, summed over micro-batches: the drift figures (algo/drift.py) and the share
# of tokens the drift gate's IS correction reweighted (0 while it is off).
RATIO_SUMS = ("ratio_mean", "logprob_abs_diff", "sampler_kl", "is_affected")
# Maxima over micro-batches (and ranks): the largest ratio, and the largest |log π − log μ| (exactly 0
# when the two agree bit for bit: sampling.on_policy: bitwise stops a run on anything else).
RATIO_MAXIMA = ("ratio_max", "logprob_abs_diff_max")


def policy_outputs(model, mb: TrainBatch, pad_id: int, temperature: float, full: bool, recording,
                   compiled: bool = False, bitwise: bool = False):
    """The student's logprobs of the completion tokens and, if `full`, its whole distributions at
    those positions, from one decoder forward (inside `recording()`: where MoE routers are
    counted). With `full` the sampled tokens' logprobs are gathered from the distributions
    instead of a second forward over the same tokens (that second forward made the
    full-vocabulary step slower than TRL GKD's). `compiled`: the head's chunks compiled
    (`train.compile`; model/scoring/logprobs.py). `bitwise` (sampling.on_policy: bitwise): the
    forward in the batch-invariant mode, the logprobs equal to the sampler's bit for bit
    (model/batch_invariant.py)."""
    with recording():
        if full:
            return completion_logprobs_and_full(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                                temperature, bitwise=bitwise)
        return completion_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                   temperature, compiled=compiled, bitwise=bitwise), None


def corrected(mb: TrainBatch, student_logprobs_BT: torch.Tensor) -> TrainBatch:
    """The micro-batch as the objective sees it under the drift gate's IS correction (algo/drift.py):
    advantages times the factor f_t (TIS: weight min(ρ, C)); under MIS the dropped tokens also
    leave the loss mask, so distribution terms (full_vocab, top-k) skip them too, while the step's
    normaliser N (counted before the correction) keeps them (algo/drift.py). Unchanged when off."""
    if mb.is_correction is None:
        return mb
    factor_BT = is_correction_factor(student_logprobs_BT.detach(), mb.sampler_logprobs_BT, *mb.is_correction)
    factor_BT = factor_BT.to(mb.advantages_BT.dtype)
    mask_BT = mb.loss_mask_BT * (factor_BT > 0) if mb.is_correction[0] == "mis" else mb.loss_mask_BT
    return replace(mb, advantages_BT=mb.advantages_BT * factor_BT, loss_mask_BT=mask_BT)


def make_optimizer(params: list, optim, total_steps: int, adamw=torch.optim.AdamW):
    """AdamW over `params` (`adamw`: its class) and its warmup-cosine LambdaLR schedule. On GPUs
    the fused AdamW (one kernel over all parameters instead of launches per tensor group); on
    CPUs torch's default, so CPU runs keep their exact figures."""
    fused = bool(params) and params[0].is_cuda
    optimizer = adamw(params, lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay, fused=fused or None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine_factor(step, optim.warmup_steps, total_steps, optim.min_lr_ratio))
    return optimizer, scheduler


class LearnerStep:
    """The training step over hooks. A subclass sets `config`, `model` (the HF model),
    `tokenizer`, `reference`, `moe`, `qat_layers`, `device` and calls `_init_step(params)`."""

    moe = None  # a RouterBalancer for MoE students where supported (engine/learner/learner.py)
    draft = None  # a DraftTrainer when draft.kind is mtp (engine/learner/draft_trainer.py; sharded: engine/sharded/sharded_draft.py)
    adamw = torch.optim.AdamW  # the optimizer's class (ShardedLearner: ShardLocalAdamW)

    def _init_step(self, params: list) -> None:
        config = self.config
        self.optim_spec = config.optim
        self.objective = config.objective
        self.reference_kl = ReferenceKL(config.reference.kl_coef, config.reference.estimator)
        self.temperature = config.sampling_temperature
        self.params = params
        self.teacher_heads: dict[str, torch.Tensor] = {}  # output heads of hidden-state teachers
        self.optimizer, self.scheduler = make_optimizer(params, config.optim, config.total_steps, self.adamw)
        self.steps_done = 0

    # -- hooks (one process here; ShardedLearner overrides them) --

    def _work(self, batch: TrainBatch) -> list[tuple[TrainBatch, float]]:
        """This process's (micro-batch, weight) pairs, on its device."""
        return [(mb.to(self.device), 1.0) for mb in batch.micro_batches(self.optim_spec.micro_batch_size)]

    def _run(self, fn, *args):
        return fn(self.model, *args)

    def _all_reduce(self, values: list[float], op: str = "sum") -> list[float]:
        return list(values)

    def _clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_spec.grad_clip))

    def _after_forwards(self) -> None:
        pass

    def _between_steps(self) -> None:
        pass
    # -- the step --

    def accumulate_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over this process's micro-batches into `.grad`; returns the loss
        and diagnostics of the whole batch."""
        self._update_fake_quant()
        self.model.train()
        num_tokens = float(batch.loss_mask_BT.sum().clamp(min=1))
        pad_id = self.tokenizer.pad_token_id
        work = self._work(batch)
        # All reference logprobs first: the grad-buffer reference needs the buffers before backward.
        # Every reference kind runs them in eval mode and gives the model back in train mode.
        ref_logprobs = (self.reference.logprobs([mb for mb, _ in work], pad_id, self.temperature)
                        if self.reference else None)
        # Every name up front: a sharded rank all-reduces the values in this order.
        sums = dict.fromkeys(("loss", "ref_kl", *RATIO_SUMS, *self.objective.sum_names()), 0.0)
        ratio_maxima = {key: 0.0 for key in RATIO_MAXIMA}
        if self.moe:
            self.moe.start_step()
        if self.draft:
            self.draft.start_step(batch.prompt_ids, batch.loss_mask_BT)
        for i, (mb, weight) in enumerate(work):
            loss, student_logprobs_BT, term_sums = self._micro_batch_loss(mb, num_tokens, pad_id, weight)
            if ref_logprobs is not None:
                term, ref_kl = self._reference_term(student_logprobs_BT, ref_logprobs[i], mb, num_tokens)
                loss = loss + term
            (loss if weight == 1.0 else loss * weight).backward()  # weight 0: an exactly zero gradient
            if weight:
                sums["loss"] += float(loss.detach())
                for key, value in term_sums.items():
                    sums[key] += value
                if ref_logprobs is not None:
                    sums["ref_kl"] += ref_kl
                self._add_ratio_stats(sums, ratio_maxima, student_logprobs_BT.detach(), mb)
        answers = self._answer_gradients(batch.answers, pad_id) if batch.answers is not None else {}
        self.model.eval()
        metrics = self._step_metrics(sums, ratio_maxima, num_tokens, ref_logprobs is not None) | answers
        if self.moe:
            metrics.update(self.moe.step_metrics())
        return metrics

    def _answer_gradients(self, answers: TrainBatch, pad_id: int) -> dict[str, float]:
        """The teachers' answers (loss.teacher_answers), learned by likelihood: Σ_t w_t·(−log π(y_t))
        over their tokens, divided by their own token count (w_t = advantages_BT, the recipe's
        coef), backward into the same `.grad` as the OPD rows. Every rank runs its share of the
        micro-batches, padded alike (`_work`)."""
        num_tokens = float(answers.loss_mask_BT.sum().clamp(min=1))
        nll = 0.0
        for mb, weight in self._work(answers):
            logprobs_BT, _ = self._run(policy_outputs, mb, pad_id, self.temperature, False, self._policy_forward,
                                       self.config.compile)
            loss = token_sum_normalized(-logprobs_BT * mb.advantages_BT, mb.loss_mask_BT, num_tokens)
            (loss if weight == 1.0 else loss * weight).backward()
            if weight:
                nll += float(-(logprobs_BT.detach() * mb.loss_mask_BT).sum())
        total = self._all_reduce([nll])[0]  # each rank its micro-batches; the count is the whole batch's
        return {"train/answer_nll": total / num_tokens, "train/answer_tokens": num_tokens}

    def _micro_batch_loss(self, mb: TrainBatch, num_tokens: float, pad_id: int, weight: float = 1.0):
        """The objective's loss on one micro-batch (divided by the step's token count), the
        student's logprobs of its completion tokens and the objective's own sums (per teacher).
        With a draft head, the head's own step on this micro-batch's policy forward first."""
        with self.draft.capturing() if self.draft else contextlib.nullcontext():
            student_logprobs_BT, student_full_logprobs_BTV = self._run(
                policy_outputs, mb, pad_id, self.temperature, self.objective.needs_student_distributions,
                self._policy_forward, self.config.compile, self.config.on_policy == "bitwise")
        if self.draft:  # its own graph on the detached states: nothing reaches the student's gradients.
            # Through `_run`: the head reads the student's embedding, final norm and LM head, gathered there.
            self._run(self._draft_learn, mb, weight)
        loss, term_sums = self.objective.loss_and_sums(corrected(mb, student_logprobs_BT), student_logprobs_BT,
                                                       student_full_logprobs_BTV, num_tokens)
        return loss, student_logprobs_BT, term_sums

    def _draft_learn(self, _model, mb: TrainBatch, weight: float) -> None:
        self.draft.learn(mb.prompt_ids, mb.loss_mask_BT, weight)

    def _reference_term(self, student_logprobs_BT, ref_logprobs_BT, mb: TrainBatch, num_tokens: float):
        """The KL-to-reference loss term (0 when its coefficient is 0) and its logged k1 mean."""
        logged = ReferenceKL.logged(student_logprobs_BT, ref_logprobs_BT, mb.loss_mask_BT, num_tokens)
        if self.reference_kl.coef == 0:
            return 0.0, logged
        return self.reference_kl.loss(student_logprobs_BT, ref_logprobs_BT, mb.loss_mask_BT, num_tokens), logged

    @staticmethod
    def _add_ratio_stats(sums, ratio_maxima, student_logprobs_BT, mb: TrainBatch) -> None:
        """The sampler-vs-learner ratio diagnostics of one micro-batch: its means weighted by its
        token count (divided by the batch's in `_step_metrics`), its maxima into the step's.

        Counts, not shares: Σ n_i·1.0 / N is exactly 1 when every ratio is, while the float shares
        n_i / N need not add up to exactly 1 (a bitwise run's ratio mean must read 1.0)."""
        count = float(mb.loss_mask_BT.sum())
        stats = mismatch_stats(student_logprobs_BT, mb.sampler_logprobs_BT, mb.loss_mask_BT)
        if mb.is_correction is not None:
            factor_BT = is_correction_factor(student_logprobs_BT, mb.sampler_logprobs_BT, *mb.is_correction)
            stats["is_affected"] = float(((factor_BT != 1.0).float() * mb.loss_mask_BT).sum()) / max(count, 1.0)
        for key in RATIO_SUMS:
            sums[key] += count * stats.get(key, 0.0)
        for key in RATIO_MAXIMA:  # a NaN stays (it must not hide behind another micro-batch's value)
            old, new = ratio_maxima[key], stats[key]
            ratio_maxima[key] = math.nan if math.isnan(old) or math.isnan(new) else max(old, new)

    def _policy_forward(self):
        """Where the MoE routers are recorded: the one policy forward per micro-batch. Not the
        reference's forward (the grad-buffer reference runs these same modules with other
        weights). The full-vocab and top-k losses take their distributions from this same
        forward (policy_outputs), so every token is counted once."""
        return self.moe.recording() if self.moe else contextlib.nullcontext()

    def _step_metrics(self, sums, ratio_maxima, num_tokens: float, has_ref: bool) -> dict[str, float]:
        """The batch's figures: this process's sums over the group (sums, and the max ratio)."""
        totals = dict(zip(sums, self._all_reduce(list(sums.values()))))
        metrics = {"train/loss": totals["loss"], "train/tokens": num_tokens}
        if has_ref:
            metrics["train/ref_kl"] = totals["ref_kl"]
        if self.objective.compares_with_sampler:
            for key in RATIO_SUMS:
                metrics[f"train/{key}"] = totals[key] / num_tokens
            maxima = self._all_reduce(list(ratio_maxima.values()), op="max")
            metrics.update({f"train/{key}": value for key, value in zip(ratio_maxima, maxima)})
        metrics.update(self.objective.finish_sums(totals))
        if self.qat_layers:
            metrics["train/fake_quant"] = float(self.steps_done >= self.config.qat.fake_quant_after_n_steps)
        return metrics

    def _update_fake_quant(self) -> None:
        """Fake quantisation on from step `fake_quant_after_n_steps`, in the model and in a copy
        reference's own model (under QAT the reference is the fake-quantised model at the
        reference weights, whichever kind holds them: docs/learner.md)."""
        if self.qat_layers:
            enabled = self.steps_done >= self.config.qat.fake_quant_after_n_steps
            set_fake_quant(self.model, enabled)
            if hasattr(self.reference, "set_fake_quant"):
                self.reference.set_fake_quant(enabled)

    # -- what the samplers get (every weight transport sends `weights()`) --

    def fp8_layers(self) -> list[str]:
        """The Linears sent as e4m3 bytes + per-row scales once fake quantisation is on
        (`sampling.weights: fp8`; model/quant/fp8_sync.py): the QAT layers. None without FP8 rollouts,
        and none with LoRA, whose merged weights are not what its QAT forward quantises."""
        if not self.config.fp8_weights or getattr(self, "peft_model", None) is not None:
            return []
        return list(self.qat_layers)

    def sends_fp8(self) -> bool:
        """The next sync carries FP8: the weights it sends train from now on under fake quantisation."""
        return bool(self.fp8_layers()) and self.steps_done >= self.config.qat.fake_quant_after_n_steps

    def weights(self) -> dict:
        """`full_weights()`, with each of `fp8_layers()` as its e4m3 bytes and fp32 scales while
        `sends_fp8()`: the values the learner's QAT forward multiplies by, at half of bf16's bytes
        (the buffers are kept and refilled in place at each sync)."""
        full = self.full_weights()
        if not full or not self.sends_fp8():  # {} on the ranks of a sharded learner other than 0
            return full
        return fp8_payload(full, self.fp8_layers(), self.__dict__.setdefault("_fp8_sent", {}))

    def set_teacher_head(self, teacher: str, head_VH: torch.Tensor) -> None:
        """Keep a hidden-state teacher's output head [V, H] (sent once per run: teachers are frozen)."""
        self.teacher_heads[teacher] = head_VH.to(self.device)

    def train_step(self, batch: TrainBatch, *payloads) -> dict[str, float]:
        """Gradients of the whole batch, clip, step. A non-finite loss or gradient skips the
        update (the weights stay as they were; on every rank alike) and is reported as
        train/skipped = 1. `payloads`: the teachers' top-k / full / hidden-state pieces the
        batch's `teacher_parts` point to (on Ray, ObjectRefs that Ray resolved in this process:
        they come from the teachers' actors straight here, never through the driver)."""
        parts = bool(batch.teacher_parts)
        if parts:
            batch = batch.with_payloads(payloads, self.teacher_heads)
        metrics = self.accumulate_gradients(batch)
        if parts:  # what came by reference, teacher actors → this learner, this step
            metrics["io/learner_teacher_bytes"] = float(tensor_bytes(payloads))
        # Grad-norm is read after backward, never between step and backward: the buffers hold
        # reference weights in that window.
        grad_norm = self._clip_grad_norm()
        skipped = not (math.isfinite(grad_norm) and math.isfinite(metrics["train/loss"]))
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
            if self.moe:  # biases for the next step, from this step's routing (none: no change)
                self.moe.update_biases()
        # A grad-buffer reference lives in the buffers between steps: keep them. Without one, free
        # them: the next backward then writes its first gradient instead of adding it to zeros
        # (the same values; a fill and an add less over every parameter a step).
        self.optimizer.zero_grad(set_to_none=not getattr(self.reference, "lives_in_grad_buffers", False))
        self._between_steps()
        with warnings.catch_warnings():  # a skipped first update is intended, not a misordered call
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.steps_done += 1
        if self.draft:
            metrics.update(self.draft.step())
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped": float(skipped)})
        return metrics

    def sft_step(self, examples: list[Prompt]) -> dict[str, float]:
        """One SFT step on chat examples (the final assistant message is the target)."""
        return self.train_step(sft_batch(self.tokenizer, examples, self.config.max_completion_tokens))

    @torch.no_grad()
    def sft_eval(self, examples: list[Prompt]) -> dict[str, float]:
        """Token-mean NLL of the replies of held-out examples, with fake quantization as trained
        (every rank runs the same number of forwards: under FSDP the gathers are collective)."""
        batch = sft_batch(self.tokenizer, examples, self.config.max_completion_tokens)
        self._update_fake_quant()
        pad_id = self.tokenizer.pad_token_id
        total, count = 0.0, 0.0
        for mb, weight in self._work(batch):
            logprobs_BT = self._run(completion_logprobs, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id)
            if weight:
                total += float(-(logprobs_BT * mb.loss_mask_BT).sum())
                count += float(mb.loss_mask_BT.sum())
        self._after_forwards()
        total, count = self._all_reduce([total, count])
        return {"eval/nll": total / max(count, 1.0), "eval/tokens": count}

    # -- the run state a checkpoint carries besides weights and optimizer --

    def _write_trainer_state(self, directory: Path, run_state: dict, **extra) -> None:
        """Scheduler, RNG and step count (plus `extra`), the driver's `run_state`, and the model
        card the driver sends in it (track/model_card.py) as the checkpoint's README.md - all
        inside the checkpoint's atomic directory."""
        run_state = dict(run_state)
        card = run_state.pop("model_card", None)
        if card is not None:
            (directory / CARD_FILE).write_text(card, encoding="utf-8")
        torch.save({**extra, "scheduler": self.scheduler.state_dict(), "torch_rng": torch.get_rng_state(),
                    "steps_done": self.steps_done}, directory / TRAINER_STATE)
        (directory / RUN_STATE).write_text(json.dumps(run_state, indent=1))

    def _read_trainer_state(self, directory: Path) -> tuple[dict, dict]:
        """Restore scheduler, RNG and step count; returns (the trainer state, the run_state)."""
        trainer = torch.load(directory / TRAINER_STATE, weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        torch.set_rng_state(trainer["torch_rng"])
        self.steps_done = trainer.get("steps_done", 0)
        return trainer, json.loads((directory / RUN_STATE).read_text())
