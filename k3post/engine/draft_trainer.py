"""The learner's draft head (model/draft_head.py): trained on the learner's own forward, with its
own AdamW, never touching the student.

How it rides along. A forward hook on the student's base model keeps the last hidden states of
the policy forward of each micro-batch (only while `capturing()`: the reference's forward runs
the same modules with other weights and must not be learned from). `learn` then runs the head on
those detached states and backpropagates its loss into the head's parameters alone: the student's
graph, gradients, RNG and optimizer never see it, so the student's trajectory is bit-identical with
the head on or off (tests/unit/test_draft_head.py).

Which positions. In the learner's right-padded layout (model/logprobs.py: pack_sequences)
completion token j of row b sits at column P_b + j. The head at column t reads h_t and x_{t+1}
and predicts x_{t+2}; it is trained where x_{t+1} and x_{t+2} are both completion tokens
(t = P_b + j − 1 for completion tokens j and j + 1), against the student's own distribution at
column t + 1 (the one that predicts x_{t+2}), at the sampling temperature (algo/draft_loss.py).
The loss is the sum over the step's positions divided by their count (normalised over the whole
step, like the student's loss, whatever the micro-batch size).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

from k3post.algo.draft_loss import acceptance_sum, soft_cross_entropy
from k3post.model.draft_head import MtpHead
from k3post.model.logprobs import hidden_states, pack_sequences

CHUNK = 1024  # positions whose [N, V] logits exist at once (recomputed in backward)
GRAD_CLIP = 1.0
WEIGHT_PREFIX = "mtp."  # the head's names in the weights a learner sends its samplers
HEAD_FILE, OPTIMIZER_FILE = "mtp_head.safetensors", "mtp_optimizer.pt"


def draft_positions(prompt_lengths: list[int], loss_mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns t) of the positions the head is trained at: x_{t+1} and x_{t+2} both completion tokens."""
    pair_BJ = loss_mask_BT[:, :-1].bool() & loss_mask_BT[:, 1:].bool()
    rows_N, j_N = pair_BJ.nonzero(as_tuple=True)
    starts_B = torch.tensor(prompt_lengths, dtype=torch.long)
    return rows_N, starts_B[rows_N] + j_N - 1


class DraftTrainer:
    """An MTP head on `model`, its AdamW, and the hook that feeds it."""

    def __init__(self, model, loss_coef: float, lr: float, temperature: float, seed: int = 0):
        self.model, self.coef, self.temperature = model, loss_coef, temperature
        self.head = MtpHead(model, seed)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=lr, weight_decay=0.0)
        self._armed, self._captured = False, []
        self._sums = {"loss": 0.0, "accept": 0.0}
        self._step_positions = 0
        base = getattr(model, model.base_model_prefix)
        self._hook = base.register_forward_hook(self._capture, with_kwargs=True)

    def _capture(self, module, args, kwargs, output) -> None:
        if self._armed:
            self._captured.append((kwargs["input_ids"], output.last_hidden_state.detach()))

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

    def learn(self, prompt_ids: list[list[int]], loss_mask_BT: torch.Tensor) -> None:
        """Backward of the head's loss on the micro-batch whose policy forward was just captured."""
        if not self._captured:
            raise RuntimeError("the draft head found no captured forward for this micro-batch")
        ids_BL, h_BLH = self._captured[-1]
        self._captured = []
        rows_N, cols_N = draft_positions([len(p) for p in prompt_ids], loss_mask_BT.cpu())
        if len(rows_N) == 0:
            return
        ce, acc = self._terms(ids_BL, h_BLH, rows_N, cols_N)
        (self.coef * ce / max(self._step_positions, 1)).backward()
        self._sums["loss"] += float(ce.detach())
        self._sums["accept"] += acc

    def step(self) -> dict[str, float]:
        """The head's optimizer step (skipped when its gradient is not finite) and its figures."""
        count = self._step_positions
        if count == 0:
            return {}
        params = list(self.head.parameters())
        norm = float(torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP))
        if torch.isfinite(torch.tensor(norm)):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"train/draft_loss": self._sums["loss"] / count, "train/draft_accept": self._sums["accept"] / count,
                "train/draft_positions": float(count)}

    @torch.no_grad()
    def acceptance(self, prompt_ids: list[list[int]], completion_ids_BT: torch.Tensor, loss_mask_BT: torch.Tensor,
                   pad_id: int) -> float:
        """Teacher-forced mean of Σ_v min(p, q) over the rows' trainable positions (held-out figure)."""
        device = self.model.get_output_embeddings().weight.device
        ids_BL, mask_BL, _ = pack_sequences(prompt_ids, completion_ids_BT.cpu(), loss_mask_BT.cpu(), pad_id)
        h_BLH = hidden_states(self.model, ids_BL.to(device), mask_BL.to(device))
        rows_N, cols_N = draft_positions([len(p) for p in prompt_ids], loss_mask_BT.cpu())
        _, acc = self._terms(ids_BL.to(device), h_BLH, rows_N, cols_N)
        return acc / max(len(rows_N), 1)

    def weights(self) -> dict[str, torch.Tensor]:
        """The head's tensors under `mtp.` names, for samplers that draft with it."""
        return {WEIGHT_PREFIX + k: v.detach() for k, v in self.head.state_dict().items()}

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file  # noqa: PLC0415

        save_file({k: v.detach().contiguous().cpu() for k, v in self.head.state_dict().items()}, directory / HEAD_FILE)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file  # noqa: PLC0415

        if not (directory / HEAD_FILE).exists():
            raise FileNotFoundError(f"checkpoint {directory} has no draft head ({HEAD_FILE}); it was written without "
                                    "draft.kind: mtp")
        self.head.load_state_dict(load_file(directory / HEAD_FILE))
        self.optimizer.load_state_dict(torch.load(directory / OPTIMIZER_FILE, weights_only=False))
