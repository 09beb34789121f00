"""Weights by name, for syncing a learner's student into its samplers.

Each storage travels once: tied tensors (the embedding and the LM head of SmolLM2) appear
under their first name only, which cuts a SmolLM2 sync by a quarter. Arrays are numpy so Ray's
object store can hand them to every reader zero-copy.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch import nn


def unique_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with every storage under its first name only (detached)."""
    seen: set[tuple[int, tuple[int, ...]]] = set()
    out = {}
    for name, tensor in state.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            out[name] = tensor.detach()
    return out


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """state_dict() with every storage under its first name only."""
    return unique_tensors(model.state_dict())


def export_weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.cpu().numpy() for name, t in unique_state(model).items()}


def import_weights(model: nn.Module, weights: dict[str, np.ndarray | torch.Tensor]) -> None:
    """Copy `weights` (as made by export_weights on the same architecture) into `model` in place.
    Every unique tensor must be present: a partial sync would leave stale layers behind."""
    expected = set(unique_state(model))
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise ValueError(f"weight sync does not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only arrays from the object store
        tensors = {k: torch.as_tensor(v) for k, v in weights.items()}
    with torch.no_grad():
        model.load_state_dict(tensors, strict=False)
