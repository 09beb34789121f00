"""The learner: one optimizer step per call (OPD, SFT or RL: an objective object decides the loss), and checkpoints.

One process on one device; a step sees every micro-batch of the batch (the step itself, shared
with the sharded learner's ranks, is engine/learner/learner_base.py). Each micro-batch's loss is
normalised by the step's *global* token count, so accumulating their gradients gives exactly
the gradient of the token-mean loss over the whole batch, whatever the micro-batch size.

Options (LearnerConfig): a KL-to-reference term whose reference weights live in the gradient
buffers (engine/learner/reference.py, docs/learner.md), LoRA adapters (the reference is then the base
model), and FP8 quantization-aware training (model/quant/qat.py), delayed by N steps if asked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from k3post.algo.objectives import Objective, SampledTokenPG
from k3post.config.draft_schema import DraftSpec
from k3post.config.schema import LoraSpec, ModelSpec, MoeSpec, OptimSpec, QatSpec, ReferenceSpec
from k3post.engine.common import check_on_policy, set_threads
from k3post.engine.learner.draft_trainer import HEAD_FILE, DraftTrainer
from k3post.engine.learner.learner_base import TRAINER_STATE, LearnerStep
from k3post.engine.learner.reference import AdapterDisabledRef, CopyRef, GradBufferRef
from k3post.engine.learner.sharded_checkpoint import has_state, load_state, save_state
from k3post.engine.transport.weight_broadcast import BroadcastSender, host_copy
from k3post.model.loading.load import load_model
from k3post.model.training.moe_stats import RouterBalancer
from k3post.model.quant.qat import prepare_fp8_qat
from k3post.model.training.weights import export_weights, unique_tensors
from k3post.track.atomic import atomic_directory, mark_complete


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
    fp8_weights: bool = False  # sampling.weights: fp8: sync quantised Linears as e4m3 + scales (model/quant/fp8_sync.py)
    moe: MoeSpec = field(default_factory=MoeSpec)  # MoE students: load metrics and routing-bias updates
    draft: DraftSpec = field(default_factory=DraftSpec)  # an MTP draft head trained alongside (engine/learner/draft_trainer.py)
    on_policy: str = "off"  # sampling.on_policy: bitwise: log π recomputed as the sampler computed log μ (model/batch_invariant.py)


class Learner(LearnerStep, BroadcastSender):
    """One process on one device; the step itself is engine/learner/learner_base.py's."""

    def __init__(self, config: LearnerConfig):
        set_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config, self.device = config, config.device
        self.model, self.tokenizer = load_model(config.student)
        check_on_policy(self.model, config.on_policy)
        self.model.to(config.device)
        self.peft_model = self._apply_lora(config.lora)
        self.qat_layers = prepare_fp8_qat(self.model) if config.qat.enabled else []
        if config.compile:
            getattr(self.model, self.model.base_model_prefix).compile()
        self._init_step([p for p in self.model.parameters() if p.requires_grad])
        self.reference = self._make_reference(config)
        # None for a dense student (no routers); records only the policy forwards (_policy_forward).
        self.moe = RouterBalancer.for_model(self.model, config.moe.bias_update, config.moe.sign_step,
                                            config.moe.bins, config.moe.log_expert_load)
        if config.draft.kind == "mtp":
            self.draft = DraftTrainer(self.model, config.draft.loss_coef, config.draft.lr, config.sampling_temperature,
                                      config.seed, hidden=config.draft.hidden)

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
            return CopyRef(config.student, config.device, qat=config.qat.enabled)
        return GradBufferRef(self.model)  # the default whenever a reference is needed

    def full_weights(self) -> dict[str, np.ndarray]:
        """The student's weights (`_student_weights`) and, with `draft.speculate`, the draft head's
        under `mtp.` names (the samplers draft with it: engine/samplers/speculative_sampler.py)."""
        student = self._student_weights()
        if self.draft is not None and self.config.draft.speculate is not None:
            student.update({k: host_copy(v) if self.config.device == "cpu" and v.dtype != torch.bfloat16 else v
                            for k, v in self.draft.weights().items()})
        return student

    def _student_weights(self) -> dict[str, np.ndarray]:
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
            return {k.replace(".base_layer", ""): host_copy(v) for k, v in unique_tensors(state).items()
                    if "lora_" not in k}
        finally:
            self.peft_model.unmerge_adapter()

    def save_checkpoint(self, directory: str, run_state: dict) -> str:
        """An HF-format checkpoint (model + tokenizer; with LoRA, the adapter), the model and
        optimizer through DCP (`dcp/`, the sharded learner's layout: a group of any size
        resumes it; LoRA keeps its optimizer in trainer_state.pt), scheduler, RNG and the
        driver's `run_state`, written atomically: a crash leaves the previous one intact."""
        with atomic_directory(Path(directory)) as tmp:
            (self.peft_model or self.model).save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)
            if self.peft_model is None:
                save_state(tmp, self.model, self.optimizer, distributed=False)
                self._write_trainer_state(tmp, run_state)
            else:
                self._write_trainer_state(tmp, run_state, optimizer=self.optimizer.state_dict())
            if self.draft is not None:  # the head and its AdamW, beside the student (engine/learner/draft_trainer.py)
                self.draft.save(tmp)
            mark_complete(tmp)
        return directory

    def load_checkpoint(self, directory: str) -> dict:
        """Restore weights, optimizer, scheduler and RNG; returns the driver's run_state.

        From `dcp/` when it is there (written by this learner or by a sharded group of any
        size); else today's earlier layout: the HF weights and the optimizer's own state_dict
        in trainer_state.pt (LoRA checkpoints, and run directories from before `dcp/`)."""
        path = Path(directory)
        if self.draft is not None:
            self.draft.load(path)
        if self.peft_model is None and has_state(path):
            load_state(path, self.model, self.optimizer, distributed=False)
            return self._read_trainer_state(path)[1]
        self._load_hf_weights(path)
        self.optimizer.load_state_dict(torch.load(path / TRAINER_STATE, weights_only=False)["optimizer"])
        return self._read_trainer_state(path)[1]

    def _load_hf_weights(self, path: Path) -> None:
        """The weights of an HF-format checkpoint directory (with LoRA: the adapter)."""
        from safetensors.torch import load_file  # noqa: PLC0415 (only needed on resume)

        state = {}
        for shard in sorted(path.glob("*.safetensors")):
            if shard.name != HEAD_FILE:  # the draft head's, beside the student (draft_trainer.py)
                state.update(load_file(shard))
        if self.peft_model is not None:
            from peft import set_peft_model_state_dict  # noqa: PLC0415

            set_peft_model_state_dict(self.peft_model, state)
            return
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        tied = set(getattr(self.model, "_tied_weights_keys", None) or [])
        if unexpected or [k for k in missing if k not in tied]:
            raise RuntimeError(f"checkpoint {path} does not match the student: missing {missing}, "
                               f"unexpected {unexpected}")
