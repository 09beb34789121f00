"""The draft head on a sharded learner's ranks: sharded like a decoder block, trained as one process trains it.

The head (model/generation/draft_head.py) is its own FSDP2 tree: `fully_shard` on its block, then on the head
(enorm, hnorm, eh_proj), with the learner's precision policy (bf16-mixed: fp32 master shards, bf16
compute) and gradients summed over ranks, never averaged: each rank's loss is already divided by
the step's global count of trained positions (engine/learner/draft_trainer.py). Its AdamW updates the local
shards (ShardLocalAdamW), its grad norm is the global one, and its loss and acceptance sums are
all-reduced, so rank 0 reports the group's figures.

Where it runs. The head reads the student's embedding, final norm and LM head, which live in the
student's FSDP root group: `learn` runs inside the root's forward (engine/learner/learner_base.py calls it
through `_run`), where that group is gathered. The head's own gathers and reductions are
collectives too, so every rank runs its forward and backward once per micro-batch, a padding
micro-batch (weight 0) or one without trained positions with its loss times 0.

How it starts. The one-process head starts from a copy of the student's last block; here the
block is copied from the module tree before sharding (`copy_last_block`, where the parameters may
still be on the meta device) and filled with the student's gathered weights once they are loaded
(`fill_block`), so both start from the same numbers. Checkpoints: `mtp_dcp/` through DCP (each rank
its shards; a group of any size, or one process, resumes it) and `mtp_head.safetensors`, gathered by
rank 0 in the student's dtype.
"""

from __future__ import annotations

import copy
from itertools import chain
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from k3post.engine.learner.draft_trainer import GRAD_CLIP, DraftTrainer
from k3post.model.generation.draft_head import MtpHead, last_block
from k3post.model.training.fsdp import Precision, ShardLocalAdamW, clip_grad_norm, master_dtype, mixed_precision, sum_gradients
from k3post.model.training.sharded_weights import gathered_state


def copy_last_block(model) -> nn.Module:
    """A copy of the student's last block, taken before sharding (its parameters may be on meta)."""
    return copy.deepcopy(last_block(model))


@torch.no_grad()
def fill_block(template: nn.Module, block: nn.Module) -> nn.Module:
    """`template` with the full weights of the student's (sharded) `block`: every rank gathers
    each parameter (a collective) and keeps the whole tensor."""
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p.detach()).clone()
            for name, p in block.named_parameters()}
    template.load_state_dict(full, strict=False, assign=True)
    still_meta = [name for name, t in chain(template.named_parameters(), template.named_buffers()) if t.is_meta]
    if still_meta:
        raise RuntimeError(f"the draft head's block has tensors the student's last block did not fill: {still_meta}")
    return template


def shard_head(head: MtpHead, precision: Precision) -> MtpHead:
    """FSDP2 on the head: its block one unit, the rest (enorm, hnorm, eh_proj) the head's root."""
    policy = mixed_precision(precision)
    fully_shard(head.block, mp_policy=policy)
    fully_shard(head, mp_policy=policy)
    sum_gradients(head)
    return head


class ShardedDraftTrainer(DraftTrainer):
    """A DraftTrainer whose head is sharded over the learner group; every method is called on
    every rank."""

    adamw = ShardLocalAdamW
    collective = True

    def __init__(self, model, block: nn.Module, draft, temperature: float, seed: int, precision: Precision,
                 export_dtype: torch.dtype, reduce: Callable[[list[float]], list[float]]):
        """`block`: `copy_last_block(model)` taken before sharding; `draft`: the recipe's DraftSpec;
        `reduce`: the learner's sum over its ranks."""
        head = MtpHead(model, seed, block=fill_block(block, last_block(model)), dtype=master_dtype(precision),
                       hidden=draft.hidden)
        self.export_dtype, self._sum_over_ranks = export_dtype, reduce
        super().__init__(model, draft.loss_coef, draft.lr, temperature, seed, head=shard_head(head, precision))

    def _clip_grad_norm(self) -> float:
        return clip_grad_norm(list(self.head.parameters()), GRAD_CLIP)

    def _reduce(self, values: list[float]) -> list[float]:
        return self._sum_over_ranks(values)

    def full_state(self) -> dict[str, torch.Tensor]:
        """The gathered head in the student's dtype, on the host, on rank 0 ({} elsewhere)."""
        return gathered_state(self.head, self.export_dtype, to_host=True)
