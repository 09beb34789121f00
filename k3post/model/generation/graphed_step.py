"""A decode step recorded once as a CUDA graph and replayed for every token, kernels unchanged.

Why. In the batch-invariant mode (model/batch_invariant.py) a decode step is hundreds of small
eager kernels (every Linear, norm and MLP on fixed blocks of rows, the Triton attention), each
launched from Python: on a GPU the launches are the step. torch.compile would remove them by
fusing kernels, which changes the arithmetic the learner reproduces (its reductions reordered),
so the mode refuses it. A CUDA graph removes the launches and keeps the kernels: `torch.cuda.graph`
records the eager step's own kernels, and a replay runs exactly those, on the same addresses, so
a replayed step computes what the eager one computes, bit for bit.

What a replay needs. Every tensor the step reads or writes keeps its address: the inputs are
copied into buffers recorded with the graph, the static KV cache (`transformers.StaticCache`)
is written in place at the position its own device counter holds (`cumulative_length`), the
outputs come back in the graph's buffers (cloned here: the next replay overwrites them), and the
weights are synced by copying into them; where a sync rebinds one, the graphs are recorded again
(`follow`). The
step must not read a value on the host (no `.item()`): the mode's attention lists each query's
keys on the device (model/invariant_attention.py: `key_order`).

Recording. Kernels are compiled and the allocator settles in one eager run of the step on a side
stream, as torch's CUDA graph notes ask. That run is real: it writes the cache at the current
position and advances each layer's counter, so the counters are put back afterwards (the slot it
wrote is written again by the first replay), and it draws from the random stream, so a graphed
run's samples follow another random stream than an eager one's: the same distribution, each
token's log μ recorded as the learner recomputes it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


class GraphedStep:
    """`step(tokens_B1, positions_B1, mask_BL, cache, *rest) -> tuple of tensors`, recorded as one
    CUDA graph per (cache, batch, cache length, rest) and replayed (module docstring)."""

    def __init__(self, step: Callable[..., tuple[torch.Tensor, ...]]):
        self.step = step
        self.graphs: dict[tuple, tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.cuda.CUDAGraph]] = {}
        self.addresses: tuple[int, ...] = ()

    def follow(self, model: torch.nn.Module) -> None:
        """Forget the recorded graphs if `model`'s parameters or buffers moved since they were
        recorded: a graph reads them at the addresses it saw, and a weight sync that rebinds a
        tensor instead of copying into it (an FP8 rollout layer switching to e4m3 bytes and
        scales) would leave it reading freed memory. Called once per sampling call."""
        addresses = tuple(t.data_ptr() for t in (*model.parameters(), *model.buffers()))
        if addresses != self.addresses:
            self.graphs.clear()
            self.addresses = addresses

    def __call__(self, tokens_B1: torch.Tensor, positions_B1: torch.Tensor, mask_BL: torch.Tensor, cache: Any,
                 *rest: Any) -> tuple[torch.Tensor, ...]:
        key = (id(cache), tuple(tokens_B1.shape), tuple(mask_BL.shape), *rest)
        if key not in self.graphs:
            self.graphs[key] = self._record(tokens_B1, positions_B1, mask_BL, cache, *rest)
        inputs, outputs, graph = self.graphs[key]
        for buffer, value in zip(inputs, (tokens_B1, positions_B1, mask_BL)):
            buffer.copy_(value)
        graph.replay()
        return tuple(out.clone() for out in outputs)

    def _record(self, tokens_B1: torch.Tensor, positions_B1: torch.Tensor, mask_BL: torch.Tensor, cache: Any,
                *rest: Any):
        inputs = (tokens_B1.clone(), positions_B1.clone(), mask_BL.clone())
        counters = [layer.cumulative_length.clone() for layer in cache.layers]
        side = torch.cuda.Stream(device=tokens_B1.device)
        side.wait_stream(torch.cuda.current_stream(tokens_B1.device))
        with torch.cuda.stream(side):
            self.step(*inputs, cache, *rest)  # compiles the kernels, settles the allocator
        torch.cuda.current_stream(tokens_B1.device).wait_stream(side)
        for layer, counter in zip(cache.layers, counters):  # the run above advanced them: put them back
            layer.cumulative_length.copy_(counter)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = self.step(*inputs, cache, *rest)
        return inputs, tuple(outputs), graph
