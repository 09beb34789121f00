"""The learner: one optimizer step per call (OPD, SFT or RL: an objective object decides the loss), and HF checkpoints.

A step sees every micro-batch of the batch. Each micro-batch's loss is normalised by the
step's *global* token count, so accumulating their gradients gives exactly the gradient of the
token-mean loss over the whole batch, whatever the micro-batch size (TRL #4719).

Options (LearnerConfig): a KL-to-reference term whose reference weights live in the gradient
buffers (engine/reference.py, docs/learner.md), LoRA adapters (the reference is then the base
model), and FP8 quantization-aware training (model/qat.py), delayed by N steps if asked.
"""

from __future__ import annotations

import contextlib
import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from k3post.algo.objectives import Objective, ReferenceKL, SampledTokenPG
from k3post.algo.policy_loss import importance_ratio_stats
from k3post.algo.schedule import warmup_cosine_factor
from k3post.config.schema import LoraSpec, ModelSpec, MoeSpec, OptimSpec, QatSpec, ReferenceSpec
from k3post.engine.common import set_threads
from k3post.engine.reference import AdapterDisabledRef, CopyRef, GradBufferRef
from k3post.engine.sft_batch import sft_batch
from k3post.engine.weight_broadcast import BroadcastSender
from k3post.model.load import load_model
from k3post.model.logprobs import completion_full_logprobs, completion_logprobs
from k3post.model.moe_stats import RouterBalancer
from k3post.model.qat import prepare_fp8_qat, set_fake_quant
from k3post.model.weights import export_weights, unique_tensors
from k3post.track.atomic import atomic_directory, mark_complete
from k3post.types import Prompt, TrainBatch

TRAINER_STATE = "trainer_state.pt"
RUN_STATE = "run_state.json"


@dataclass(frozen=True, kw_only=True)
class LearnerConfig:
    """Everything a learner is built from; by keyword (the launch layer fills it from a recipe)."""

    student: ModelSpec
    optim: OptimSpec
    objective: Objective = field(default_factory=SampledTokenPG)  # what a step minimises (algo/objectives.py)
    reference: ReferenceSpec = field(default_factory=ReferenceSpec)  # a KL-to-reference term, and its weights
    total_steps: int
    sampling_temperature: float = 1.0  # the learner models the distribution the sampler drew from
    seed: int = 0
    num_threads: int | None = None
    lora: LoraSpec = field(default_factory=LoraSpec)
    qat: QatSpec = field(default_factory=QatSpec)
    max_completion_tokens: int = 256  # SFT replies are truncated to this many tokens
    device: str = "cpu"
    compile: bool = False  # torch.compile the decoder blocks (fuses FP8 fake quantization on GPUs)
    moe: MoeSpec = field(default_factory=MoeSpec)  # MoE students: load metrics and routing-bias updates


def _host_copy(t: torch.Tensor) -> np.ndarray | torch.Tensor:
    """A host copy: numpy where it can hold the dtype (zero-copy for Ray), else a torch tensor."""
    t = t.detach().to("cpu", copy=True)
    return t if t.dtype == torch.bfloat16 else t.numpy()


class Learner(BroadcastSender):
    def __init__(self, config: LearnerConfig):
        set_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config, self.optim_spec = config, config.optim
        self.model, self.tokenizer = load_model(config.student)
        self.model.to(config.device)
        self.peft_model = self._apply_lora(config.lora)
        self.qat_layers = prepare_fp8_qat(self.model) if config.qat.enabled else []
        if config.compile:
            getattr(self.model, self.model.base_model_prefix).compile()
        self.objective = config.objective
        self.reference_kl = ReferenceKL(config.reference.kl_coef, config.reference.estimator)
        self.temperature = config.sampling_temperature
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.optim.lr, betas=config.optim.betas,
                                           weight_decay=config.optim.weight_decay)
        optim = config.optim
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: warmup_cosine_factor(step, optim.warmup_steps, config.total_steps, optim.min_lr_ratio),
        )
        self.reference = self._make_reference(config)
        # None for a dense student (no routers); records only the policy forwards (_policy_forward).
        self.moe = RouterBalancer.for_model(self.model, config.moe.bias_update, config.moe.sign_step,
                                            config.moe.bins, config.moe.log_expert_load)
        self.steps_done = 0

    def _apply_lora(self, lora: LoraSpec):
        if lora.rank == 0:
            return None
        from peft import LoraConfig, get_peft_model  # noqa: PLC0415

        peft_model = get_peft_model(self.model, LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                                           lora_dropout=lora.dropout,
                                                           target_modules=list(lora.target_modules)))
        self.model = peft_model.get_base_model()  # the same modules, LoRA layers injected
        return peft_model

    def _make_reference(self, config: LearnerConfig):
        ref = config.reference
        if ref.kind == "none" and ref.kl_coef == 0:
            return None
        if self.peft_model is not None:
            return AdapterDisabledRef(self.peft_model, self.model)
        if ref.kind == "copy":
            return CopyRef(config.student, config.device)
        return GradBufferRef(self.model)  # the default whenever a reference is needed

    def accumulate_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over every micro-batch into `.grad`; returns the loss and diagnostics."""
        self._update_fake_quant()
        self.model.train()
        num_tokens = float(batch.loss_mask_BT.sum().clamp(min=1))
        pad_id = self.tokenizer.pad_token_id
        micro_batches = [mb.to(self.config.device) for mb in batch.micro_batches(self.optim_spec.micro_batch_size)]
        # All reference logprobs first: the grad-buffer reference needs the buffers before backward.
        ref_logprobs = self.reference.logprobs(micro_batches, pad_id, self.temperature) if self.reference else None
        totals, ratio_stats = {"loss": 0.0, "ref_kl": 0.0}, []
        if self.moe:
            self.moe.start_step()
        for i, mb in enumerate(micro_batches):
            loss, student_logprobs_BT = self._micro_batch_loss(mb, num_tokens, pad_id)
            if ref_logprobs is not None:
                loss = loss + self._reference_term(student_logprobs_BT, ref_logprobs[i], mb, num_tokens, totals)
            loss.backward()
            totals["loss"] += float(loss.detach())
            weight = float(mb.loss_mask_BT.sum()) / num_tokens
            ratio_stats.append((weight, importance_ratio_stats(student_logprobs_BT.detach(), mb.sampler_logprobs_BT,
                                                               mb.loss_mask_BT)))
        self.model.eval()
        metrics = self._step_metrics(totals, ratio_stats, num_tokens, ref_logprobs is not None)
        if self.moe:
            metrics.update(self.moe.step_metrics())
        return metrics

    def _micro_batch_loss(self, mb: TrainBatch, num_tokens: float, pad_id: int):
        """The objective's loss on one micro-batch (divided by the step's token count) and the
        student's logprobs of its completion tokens."""
        with self._policy_forward():
            student_logprobs_BT = completion_logprobs(self.model, mb.prompt_ids, mb.completion_ids_BT,
                                                      mb.loss_mask_BT, pad_id, self.temperature)
        student_full_logprobs_BTV = None
        if self.objective.needs_student_distributions:
            student_full_logprobs_BTV = completion_full_logprobs(self.model, mb.prompt_ids, mb.completion_ids_BT,
                                                                 mb.loss_mask_BT, pad_id, self.temperature)
        return self.objective.loss(mb, student_logprobs_BT, student_full_logprobs_BTV, num_tokens), student_logprobs_BT

    def _reference_term(self, student_logprobs_BT, ref_logprobs_BT, mb: TrainBatch, num_tokens: float,
                        totals: dict[str, float]):
        """The KL-to-reference loss term (0 when its coefficient is 0); its k1 mean is logged."""
        totals["ref_kl"] += ReferenceKL.logged(student_logprobs_BT, ref_logprobs_BT, mb.loss_mask_BT, num_tokens)
        if self.reference_kl.coef == 0:
            return 0.0
        return self.reference_kl.loss(student_logprobs_BT, ref_logprobs_BT, mb.loss_mask_BT, num_tokens)

    def _policy_forward(self):
        """Where the MoE routers are recorded: the one policy forward per micro-batch. Not the
        reference's forward (the grad-buffer reference runs these same modules with other
        weights) nor the full-vocab loss's second pass over the same tokens (same routing;
        recording it would count every token twice)."""
        return self.moe.recording() if self.moe else contextlib.nullcontext()

    def _step_metrics(self, totals, ratio_stats, num_tokens: float, has_ref: bool) -> dict[str, float]:
        metrics = {"train/loss": totals["loss"], "train/tokens": num_tokens}
        if has_ref:
            metrics["train/ref_kl"] = totals["ref_kl"]
        if self.objective.compares_with_sampler:
            for key in ("ratio_mean", "logprob_abs_diff"):
                metrics[f"train/{key}"] = sum(w * s[key] for w, s in ratio_stats)
            metrics["train/ratio_max"] = max(s["ratio_max"] for _, s in ratio_stats)
        if self.qat_layers:
            metrics["train/fake_quant"] = float(self.steps_done >= self.config.qat.fake_quant_after_n_steps)
        return metrics

    def _update_fake_quant(self) -> None:
        if self.qat_layers:
            set_fake_quant(self.model, self.steps_done >= self.config.qat.fake_quant_after_n_steps)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Gradients of the whole batch, clip, step. A non-finite loss or gradient skips the
        update (the weights stay as they were) and is reported as train/skipped = 1."""
        metrics = self.accumulate_gradients(batch)
        # Grad-norm is read after backward, never between step and backward: the buffers hold
        # reference weights in that window.
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_spec.grad_clip))
        skipped = not (math.isfinite(grad_norm) and math.isfinite(metrics["train/loss"]))
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
            if self.moe:  # biases for the next step, from this step's routing (none: no change)
                self.moe.update_biases()
        # Keep the buffers (set_to_none=False): the grad-buffer reference lives in them.
        self.optimizer.zero_grad(set_to_none=False)
        with warnings.catch_warnings():  # a skipped first update is intended, not a misordered call
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        self.steps_done += 1
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped": float(skipped)})
        return metrics

    def sft_step(self, examples: list[Prompt]) -> dict[str, float]:
        """One SFT step on chat examples (the final assistant message is the target)."""
        return self.train_step(sft_batch(self.tokenizer, examples, self.config.max_completion_tokens))

    @torch.no_grad()
    def sft_eval(self, examples: list[Prompt]) -> dict[str, float]:
        """Token-mean NLL of the replies of held-out examples, with fake quantization as trained."""
        batch = sft_batch(self.tokenizer, examples, self.config.max_completion_tokens)
        self._update_fake_quant()
        pad_id = self.tokenizer.pad_token_id
        total, count = 0.0, 0.0
        for mb in batch.micro_batches(self.optim_spec.micro_batch_size):
            logprobs_BT = completion_logprobs(self.model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id)
            total += float(-(logprobs_BT * mb.loss_mask_BT).sum())
            count += float(mb.loss_mask_BT.sum())
        return {"eval/nll": total / max(count, 1.0), "eval/tokens": count}

    def weights(self) -> dict[str, np.ndarray]:
        """The student's weights by name, for the samplers (each tied storage once; with LoRA,
        the adapters merged into plain base-model names).

        On a GPU, or in bfloat16 (which numpy lacks), they are the live tensors, not copies: an
        in-process sampler copies them at once, device to device; Ray pickles them for actors."""
        if self.peft_model is None:
            if self.config.device != "cpu" or self.config.student.dtype == "bfloat16":
                return unique_tensors(self.model.state_dict())
            return export_weights(self.model)
        self.peft_model.merge_adapter()
        try:  # copies: unmerging below restores the base weights in place
            state = self.model.state_dict()
            return {k.replace(".base_layer", ""): _host_copy(v) for k, v in unique_tensors(state).items()
                    if "lora_" not in k}
        finally:
            self.peft_model.unmerge_adapter()

    def save_checkpoint(self, directory: str, run_state: dict) -> str:
        """An HF-format checkpoint (model + tokenizer; with LoRA, the adapter) plus optimizer,
        scheduler, RNG and the driver's `run_state`, written atomically: a crash leaves the
        previous one intact."""
        with atomic_directory(Path(directory)) as tmp:
            (self.peft_model or self.model).save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "torch_rng": torch.get_rng_state(), "steps_done": self.steps_done}, tmp / TRAINER_STATE)
            (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=1))
            mark_complete(tmp)
        return directory

    def load_checkpoint(self, directory: str) -> dict:
        """Restore weights, optimizer, scheduler and RNG; returns the driver's run_state."""
        from safetensors.torch import load_file  # noqa: PLC0415 (only needed on resume)

        path = Path(directory)
        state = {}
        for shard in sorted(path.glob("*.safetensors")):
            state.update(load_file(shard))
        target = self.peft_model or self.model
        if self.peft_model is not None:
            from peft import set_peft_model_state_dict  # noqa: PLC0415

            set_peft_model_state_dict(self.peft_model, state)
        else:
            missing, unexpected = target.load_state_dict(state, strict=False)
            tied = set(getattr(target, "_tied_weights_keys", None) or [])
            if unexpected or [k for k in missing if k not in tied]:
                raise RuntimeError(f"checkpoint {path} does not match the student: missing {missing}, "
                                   f"unexpected {unexpected}")
        trainer = torch.load(path / TRAINER_STATE, weights_only=False)
        self.optimizer.load_state_dict(trainer["optimizer"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        torch.set_rng_state(trainer["torch_rng"])
        self.steps_done = trainer.get("steps_done", 0)
        return json.loads((path / RUN_STATE).read_text())
