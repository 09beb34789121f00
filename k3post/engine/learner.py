"""The learner: one optimizer step of on-policy distillation per call, and HF checkpoints.

A step sees every micro-batch of the batch. Each micro-batch's loss is normalised by the
step's *global* token count, so accumulating their gradients gives exactly the gradient of the
token-mean loss over the whole batch, whatever the micro-batch size (TRL #4719).
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from k3post.algo.aggregate import token_sum_normalized
from k3post.algo.opd import full_vocab_reverse_kl_loss
from k3post.algo.policy_loss import importance_ratio_stats, importance_sampled_pg_loss
from k3post.algo.schedule import warmup_cosine_factor
from k3post.config.schema import LossSpec, ModelSpec, OptimSpec
from k3post.engine.common import set_threads
from k3post.model.load import load_model
from k3post.model.logprobs import completion_full_logprobs, completion_logprobs
from k3post.model.weights import export_weights
from k3post.track.atomic import atomic_directory, mark_complete
from k3post.types import TrainBatch

TRAINER_STATE = "trainer_state.pt"
RUN_STATE = "run_state.json"


def _sampled_token_loss(model, mb: TrainBatch, student_lp_BT, num_tokens: float, pad_id: int, temperature: float):
    loss_BT = importance_sampled_pg_loss(student_lp_BT, mb.sampler_logprobs_BT, mb.advantages_BT)
    return token_sum_normalized(loss_BT, mb.loss_mask_BT, num_tokens)


def _full_vocab_loss(model, mb: TrainBatch, student_lp_BT, num_tokens: float, pad_id: int, temperature: float):
    if mb.teacher_full_logprobs_BTV is None:
        raise ValueError("the full_vocab loss needs teacher_full_logprobs_BTV in the batch")
    student_BTV = completion_full_logprobs(model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT, pad_id,
                                           temperature)
    return full_vocab_reverse_kl_loss(student_BTV, mb.teacher_full_logprobs_BTV, mb.loss_mask_BT, num_tokens)


# loss kind (recipe `loss.kind`) -> per-micro-batch loss; one entry per objective, no if/elif.
LOSSES: dict[str, Callable[..., torch.Tensor]] = {"sampled_token": _sampled_token_loss,
                                                  "full_vocab": _full_vocab_loss}


class Learner:
    def __init__(self, student: ModelSpec, optim: OptimSpec, loss: LossSpec, total_steps: int,
                 sampling_temperature: float = 1.0, seed: int = 0, num_threads: int | None = None):
        set_threads(num_threads)
        torch.manual_seed(seed)
        self.model, self.tokenizer = load_model(student)
        self.optim_spec, self.loss_fn = optim, LOSSES[loss.kind]
        # The learner models the distribution the sampler drew from: softmax(logits / T).
        self.temperature = sampling_temperature
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=optim.lr, betas=optim.betas,
                                           weight_decay=optim.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: warmup_cosine_factor(step, optim.warmup_steps, total_steps, optim.min_lr_ratio),
        )

    def accumulate_gradients(self, batch: TrainBatch) -> dict[str, float]:
        """Forward/backward over every micro-batch into `.grad`; returns the loss and ratio stats."""
        self.model.train()
        num_tokens = float(batch.loss_mask_BT.sum().clamp(min=1))
        pad_id = self.tokenizer.pad_token_id
        total_loss, ratio_stats = 0.0, []
        for mb in batch.micro_batches(self.optim_spec.micro_batch_size):
            student_lp_BT = completion_logprobs(self.model, mb.prompt_ids, mb.completion_ids_BT, mb.loss_mask_BT,
                                                pad_id, self.temperature)
            loss = self.loss_fn(self.model, mb, student_lp_BT, num_tokens, pad_id, self.temperature)
            loss.backward()
            total_loss += float(loss.detach())
            weight = float(mb.loss_mask_BT.sum()) / num_tokens
            ratio_stats.append((weight, importance_ratio_stats(student_lp_BT.detach(), mb.sampler_logprobs_BT,
                                                               mb.loss_mask_BT)))
        self.model.eval()
        metrics = {"train/loss": total_loss, "train/tokens": num_tokens}
        for key in ("ratio_mean", "logprob_abs_diff"):
            metrics[f"train/{key}"] = sum(w * s[key] for w, s in ratio_stats)
        metrics["train/ratio_max"] = max(s["ratio_max"] for _, s in ratio_stats)
        return metrics

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Gradients of the whole batch, clip, step. A non-finite loss or gradient skips the
        update (the weights stay as they were) and is reported as train/skipped = 1."""
        metrics = self.accumulate_gradients(batch)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.optim_spec.grad_clip))
        skipped = not (math.isfinite(grad_norm) and math.isfinite(metrics["train/loss"]))
        lr = self.scheduler.get_last_lr()[0]
        if not skipped:
            self.optimizer.step()
        # Keep the buffers (set_to_none=False): later stages hold reference weights in them.
        self.optimizer.zero_grad(set_to_none=False)
        with warnings.catch_warnings():  # a skipped first update is intended, not a misordered call
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()
        metrics.update({"train/grad_norm": grad_norm, "train/lr": lr, "train/skipped": float(skipped)})
        return metrics

    def weights(self) -> dict[str, np.ndarray]:
        """The student's weights by name, for the samplers (each tied storage once)."""
        return export_weights(self.model)

    def save_checkpoint(self, directory: str, run_state: dict) -> str:
        """An HF-format checkpoint (model + tokenizer) plus optimizer, scheduler, RNG and the
        driver's `run_state`, written atomically: a crash leaves the previous one intact."""
        with atomic_directory(Path(directory)) as tmp:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            torch.save({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                        "torch_rng": torch.get_rng_state()}, tmp / TRAINER_STATE)
            (tmp / RUN_STATE).write_text(json.dumps(run_state, indent=1))
            mark_complete(tmp)
        return directory

    def load_checkpoint(self, directory: str) -> dict:
        """Restore weights, optimizer, scheduler and RNG; returns the driver's run_state."""
        path = Path(directory)
        from safetensors.torch import load_file  # noqa: PLC0415 (only needed on resume)

        state = {}
        for shard in sorted(path.glob("*.safetensors")):
            state.update(load_file(shard))
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied]:
            raise RuntimeError(f"checkpoint {path} does not match the student: missing {missing}, "
                               f"unexpected {unexpected}")
        trainer = torch.load(path / TRAINER_STATE, weights_only=False)
        self.optimizer.load_state_dict(trainer["optimizer"])
        self.scheduler.load_state_dict(trainer["scheduler"])
        torch.set_rng_state(trainer["torch_rng"])
        return json.loads((path / RUN_STATE).read_text())
