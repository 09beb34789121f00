"""Train and eval mode, set for a block and put back after it.

A module's mode changes what its forward computes: in train mode dropout (attention, hidden,
LoRA's) zeroes a random share of activations and rescales the rest by 1/(1 − p), so a forward is
a random draw; in eval mode dropout is the identity and the forward is a function of the weights
and the inputs alone. The reference of a KL-to-reference term is a fixed model, so its logprobs
are taken in eval mode — whichever reference kind holds its weights (engine/learner/reference.py,
engine/sharded/sharded_reference.py) — while the policy forwards of the same step run in the mode the
learner set (train: dropout is part of the training). Eval mode is set on the whole module tree
and each submodule's own flag is restored after, so a submodule the caller kept in eval mode
(a frozen part) stays there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from torch import nn


@contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """`module` and all its submodules in eval mode inside the block; each one's previous mode
    after it (also when the block raises)."""
    before = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, training in before:
            m.training = training
