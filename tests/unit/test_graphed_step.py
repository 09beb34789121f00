"""model/generation/graphed_step.py's bookkeeping that needs no GPU: a recorded CUDA graph reads the
weights at the addresses it saw, so `follow` forgets the graphs when a parameter or buffer moved
(a sync that rebinds a tensor) and keeps them when the weights were copied in place. The replay
itself is tests/gpu/test_on_policy_cuda.py's."""

from __future__ import annotations

import torch
from torch import nn

from k3post.model.generation.graphed_step import GraphedStep


def test_graphs_are_forgotten_when_a_weight_moves_and_kept_when_it_is_copied_into():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    step = GraphedStep(lambda *args: ())
    step.follow(model)
    step.graphs["recorded"] = ((), (), None)
    with torch.no_grad():
        model[0].weight.copy_(torch.ones(4, 4))  # a sync in place: same addresses
        model[1].running_mean.add_(1.0)
    step.follow(model)
    assert "recorded" in step.graphs
    model[0].weight.data = torch.zeros(4, 4)  # rebound: a graph would read the freed tensor
    step.follow(model)
    assert step.graphs == {}
    step.graphs["recorded"] = ((), (), None)
    model[1].register_buffer("running_var", torch.ones(4))  # a buffer rebound too
    step.follow(model)
    assert step.graphs == {}
