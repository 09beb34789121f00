"""The learner's draft head (model/generation/draft_head.py): trained on the learner's own forward, with its
own AdamW, never touching the student.

How it rides along. A forward hook on the student's base model keeps the last hidden states of
the policy forward of each micro-batch (for a `draft.hidden: residual` head, those its final
norm received, kept by a hook on the norm) (only while `capturing()`: the reference's forward runs
the same modules with other weights and must not be learned from). `learn` then runs the head on
those detached states and backpropagates its loss into the head's parameters alone: the student's
graph, gradients, RNG and optimizer never see it, so the student's trajectory is bit-identical with
the head on or off (tests/unit/test_draft_head.py).

Which positions. In the learner's right-padded layout (model/scoring/logprobs.py: pack_sequences)
completion token j of row b sits at column P_b + j. The head at column t reads h_t and x_{t+1}
and predicts x_{t+2}; it is trained where x_{t+1} and x_{t+2} are both completion tokens
(t = P_b + j − 1 for completion tokens j and j + 1), against the student's own distribution at
column t + 1 (the one that predicts x_{t+2}), at the sampling temperature (algo/draft_loss.py).
The loss is the sum over the step's positions divided by their count (normalised over the whole
step, like the student's loss, whatever the micro-batch size, and however the micro-batches are
spread over a sharded learner's ranks: engine/sharded/sharded_draft.py).

Checkpoints: `mtp_dcp/` holds the head and its AdamW through torch.distributed.checkpoint (the
student's own `dcp/` layout, so one process and a group of any size resume each other's), and
`mtp_head.safetensors` the whole head in the student's dtype (what `k3post export-draft` and
`k3post export-fp8` read).
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from k3post.algo.draft_loss import acceptance_sum, soft_cross_entropy
from k3post.engine.learner.sharded_checkpoint import load_state, save_state
from k3post.model.generation.draft_head import Hidden, MtpHead
from k3post.model.scoring.logprobs import hidden_states, pack_sequences

CHUNK = 1024  # positions whose [N, V] logits exist at once (recomputed in backward)
GRAD_CLIP = 1.0
WEIGHT_PREFIX = "mtp."  # the head's names in the weights a learner sends its samplers
HEAD_FILE, HEAD_DCP = "mtp_head.safetensors", "mtp_dcp"
LEGACY_OPTIMIZER_FILE = "mtp_optimizer.pt"  # written before mtp_dcp/: resumed by one process only


def draft_positions(prompt_lengths: list[int], loss_mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns t) of the positions the head is trained at: x_{t+1} and x_{t+2} both completion tokens."""
    pair_BJ = loss_mask_BT[:, :-1].bool() & loss_mask_BT[:, 1:].bool()
    rows_N, j_N = pair_BJ.nonzero(as_tuple=True)
    starts_B = torch.tensor(prompt_lengths, dtype=torch.long)
    return rows_N, starts_B[rows_N] + j_N - 1


class DraftTrainer:
    """An MTP head on `model`, its AdamW, and the hook that feeds it (one process; a sharded
    learner's ranks run engine/sharded/sharded_draft.py's subclass over the same steps)."""

    adamw = torch.optim.AdamW
    collective = False  # True on a sharded rank: every micro-batch runs the head's forward and backward

    def __init__(self, model, loss_coef: float, lr: float, temperature: float, seed: int = 0,
                 head: MtpHead | None = None, hidden: Hidden = "final_norm"):
        self.model, self.coef, self.temperature = model, loss_coef, temperature
        self.head = head if head is not None else MtpHead(model, seed, hidden=hidden)
        self.optimizer = self.adamw(self.head.parameters(), lr=lr, weight_decay=0.0)
        self._armed, self._captured, self._residual = False, [], None
        self._sums = {"loss": 0.0, "accept": 0.0}
        self._step_positions = 0
        base = getattr(model, model.base_model_prefix)
        self._hooks = [base.register_forward_hook(self._capture, with_kwargs=True)]
        if self.head.hidden == "residual":
            self._hooks.append(base.norm.register_forward_hook(self._capture_residual))

    def _capture_residual(self, module, args, output) -> None:
        if self._armed:
            self._residual = args[0].detach()

    def _capture(self, module, args, kwargs, output) -> None:
        if self._armed:
            h = self._residual if self.head.hidden == "residual" else output.last_hidden_state
            self._captured.append((kwargs["input_ids"], h.detach()))

    @contextmanager
    def capturing(self):
        """Keep the hidden states of the forwards run inside (the policy forward of a micro-batch)."""
        self._armed, self._captured = True, []
        try:
            yield
        finally:
            self._armed = False

    def start_step(self, prompt_ids: list[list[int]], loss_mask_BT: torch.Tensor) -> None:
        """The step's trained positions, counted over the whole batch (the loss's normaliser)."""
        self._step_positions = len(draft_positions([len(p) for p in prompt_ids], loss_mask_BT.cpu())[0])
        self._sums = {"loss": 0.0, "accept": 0.0}

    def _terms(self, ids_BL: torch.Tensor, h_BLH: torch.Tensor, rows_N: torch.Tensor, cols_N: torch.Tensor):
        """(Σ soft cross-entropy, Σ acceptance) over the positions, chunked; differentiable in the head."""
        B, L = ids_BL.shape
        positions_BL = torch.arange(L - 1, device=ids_BL.device)[None].expand(B, -1)
        g_BLH = self.head(h_BLH[:, :-1], ids_BL[:, 1:], positions_BL)
        rows_N, cols_N = rows_N.to(ids_BL.device), cols_N.to(ids_BL.device)
        g_NH, target_NH = g_BLH[rows_N, cols_N], h_BLH[rows_N, cols_N + 1]
        ce, acc = g_NH.new_zeros((), dtype=torch.float32), 0.0
        for start in range(0, len(rows_N), CHUNK):
            args = (g_NH[start:start + CHUNK], target_NH[start:start + CHUNK])
            piece_ce, piece_acc = (checkpoint(self._chunk, *args, use_reentrant=False) if torch.is_grad_enabled()
                                   else self._chunk(*args))
            ce, acc = ce + piece_ce, acc + float(piece_acc)
        return ce, acc

    def _chunk(self, g_NH: torch.Tensor, target_NH: torch.Tensor):
        draft_NV, target_NV = self.head.logits(g_NH), self.head.student_logits(target_NH)
        return (soft_cross_entropy(draft_NV, target_NV, self.temperature),
                acceptance_sum(draft_NV, target_NV, self.temperature))

    def learn(self, prompt_ids: list[list[int]], loss_mask_BT: torch.Tensor, weight: float = 1.0) -> None:
        """Backward of the head's loss on the micro-batch whose policy forward was just captured.
        `weight` 0: a sharded rank's padding micro-batch (engine/sharded/sharded_learner.py), which, like
        one without trained positions there, runs the head's forward and backward for an exactly
        zero gradient (the head's gathers and reductions are collective) and counts nowhere."""
        if not self._captured:
            raise RuntimeError("the draft head found no captured forward for this micro-batch")
        ids_BL, h_BLH = self._captured[-1]
        self._captured = []
        rows_N, cols_N = draft_positions([len(p) for p in prompt_ids], loss_mask_BT.cpu())
        if len(rows_N) == 0 or weight == 0:
            if self.collective:
                self._zero_pass(ids_BL, h_BLH)
            return
        ce, acc = self._terms(ids_BL, h_BLH, rows_N, cols_N)
        (self.coef * ce / max(self._step_positions, 1)).backward()
        self._sums["loss"] += float(ce.detach())
        self._sums["accept"] += acc

    def _zero_pass(self, ids_BL: torch.Tensor, h_BLH: torch.Tensor) -> None:
        """The head's forward and backward over the micro-batch with the loss times 0."""
        B, L = ids_BL.shape
        positions_BL = torch.arange(L - 1, device=ids_BL.device)[None].expand(B, -1)
        (self.head(h_BLH[:, :-1], ids_BL[:, 1:], positions_BL).float().sum() * 0.0).backward()

    def _clip_grad_norm(self) -> float:
        return float(torch.nn.utils.clip_grad_norm_(list(self.head.parameters()), GRAD_CLIP))

    def _reduce(self, values: list[float]) -> list[float]:
        """Sums over the learner's ranks (one process: the values themselves)."""
        return list(values)

    def step(self) -> dict[str, float]:
        """The head's optimizer step (skipped when its gradient is not finite) and its figures."""
        count = self._step_positions
        if count == 0:
            self.optimizer.zero_grad(set_to_none=True)  # a sharded rank's zero passes left zeros
            return {}
        if math.isfinite(self._clip_grad_norm()):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss, accept = self._reduce([self._sums["loss"], self._sums["accept"]])
        return {"train/draft_loss": loss / count, "train/draft_accept": accept / count,
                "train/draft_positions": float(count)}

    @torch.no_grad()
    def acceptance(self, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor,
                   pad_id: int) -> float:
        """Teacher-forced mean of Σ_v min(p, q) over the rows' trainable positions (held-out figure)."""
        device = self.model.get_output_embeddings().weight.device
        ids_BL, mask_BL, _ = pack_sequences(prompt_ids, completion_ids_BT.cpu(), loss_mask_BT.cpu(), pad_id)
        with self.head.reading():
            h_BLH = hidden_states(self.model, ids_BL.to(device), mask_BL.to(device))
        rows_N, cols_N = draft_positions([len(p) for p in prompt_ids], loss_mask_BT.cpu())
        _, acc = self._terms(ids_BL.to(device), h_BLH, rows_N, cols_N)
        return acc / max(len(rows_N), 1)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole head by name, as live tensors ({} on a sharded group's other ranks)."""
        return {k: v.detach() for k, v in self.head.state_dict().items()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The head's tensors under `mtp.` names, for samplers that draft with it."""
        return {WEIGHT_PREFIX + k: v for k, v in self.full_state().items()}

    def save(self, directory: Path) -> None:
        """`mtp_head.safetensors` (the whole head; its metadata says which hidden state it reads)
        and `mtp_dcp/` (head + AdamW, reshardable)."""
        from safetensors.torch import save_file  # noqa: PLC0415

        state = self.full_state()
        if state:
            save_file({k: v.contiguous().cpu() for k, v in state.items()}, directory / HEAD_FILE,
                      metadata={"format": "pt", "hidden": self.head.hidden})
        save_state(directory, self.head, self.optimizer, distributed=self.collective, subdir=HEAD_DCP)

    def load(self, directory: Path) -> None:
        if (directory / HEAD_DCP).is_dir():
            load_state(directory, self.head, self.optimizer, distributed=self.collective, subdir=HEAD_DCP)
            return
        if not (directory / HEAD_FILE).exists():
            raise FileNotFoundError(f"checkpoint {directory} has no draft head ({HEAD_DCP}/); it was written without "
                                    "draft.kind: mtp")
        if self.collective:
            raise FileNotFoundError(f"checkpoint {directory} keeps its draft head's optimizer in "
                                    f"{LEGACY_OPTIMIZER_FILE}, which one unsharded learner rank resumes, not a "
                                    f"sharded one")
        from safetensors.torch import load_file  # noqa: PLC0415

        self.head.load_state_dict(load_file(directory / HEAD_FILE))
        self.optimizer.load_state_dict(torch.load(directory / LEGACY_OPTIMIZER_FILE, weights_only=False))
