"""One GEMM per group of projections that read the same input, in a compiled sampler.

Why. At the batch sizes of rollouts (1-32 rows) each of a decode step's GEMMs takes a few
microseconds however few bytes it reads (docs/benchmarks.md, "The sampler's decode step against
the roofline"), and a transformers decoder layer runs seven: q, k and v read the same normed
hidden state, gate and up another. One GEMM over a group's stacked weights does the group's work
in one kernel, with more output columns to spread over the GPU.

How, without writing model code. `fuse_projections` stacks each group's weights (and biases) into
one tensor and makes every member's own parameter a view of its rows: the state dict, the weight
sync (`load_state_dict` copies in place, so into the stack) and the weight checksums see the same
names and values as before. Each member Linear becomes a `RowsOf`: run eagerly (a prefill, a
CPU) it is the Linear it was, over its own rows; traced by torch.compile it computes the group's
whole GEMM and keeps its own columns, so the members' GEMMs are one expression over the same
tensors, and `ComputedOnce` (an Inductor post-grad pass: common-subexpression elimination over
pure tensor ops) keeps one. A sampler fuses the model it compiles and compiles its steps with
`step_compile_options()`.

A group of FP8 rollout Linears (model/quant/fp8_linear.py, holding e4m3 bytes and per-row scales)
stacks the same way, by the layer class's own `stack_group`: then the group's input is also
quantised once per step instead of once per member (the quantisation's ops are pure too).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

# The member names of the groups, as transformers' decoder layers name them.
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class RowsOf(nn.Module):
    """Linear layer whose weight (and bias) is rows [start, stop) of a group's stacked ones."""

    def __init__(self, weight_stack: torch.Tensor, bias_stack: torch.Tensor | None, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        # Not in the state dict (persistent=False): the members' own names carry the values.
        self.register_buffer("weight_stack", weight_stack, persistent=False)
        self.register_buffer("bias_stack", bias_stack, persistent=False)
        self.weight = nn.Parameter(weight_stack[start:stop], requires_grad=False)
        self.bias = None if bias_stack is None else nn.Parameter(bias_stack[start:stop], requires_grad=False)

    def __deepcopy__(self, memo: dict) -> RowsOf:
        return copy_with_row_views(self, memo, (self.start, self.stop))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # the group's GEMM, which ComputedOnce runs once
            return F.linear(x, self.weight_stack, self.bias_stack)[..., self.start:self.stop]
        return F.linear(x, self.weight, self.bias)


def copy_with_row_views(layer: nn.Module, memo: dict, rows: tuple[int, int] | None) -> nn.Module:
    """A deep copy of a stacked member `layer` whose `weight` (and `bias`) are again views of `rows`
    (start, stop) of its copied `weight_stack` (`bias_stack`), as in `layer`; a plain deep copy
    where `rows` is None (a layer not stacked).

    Why: a default deep copy clones each Parameter on its own, apart from the copied stack, so a
    weight sync into the copy (such as the draft head's, whose block is a copy of a fused student
    block) would miss the stack the compiled path reads, which would go on computing with the
    weights of the moment of the copy. `memo` (deepcopy's) makes the members of one group share one
    copied stack, and plain tensors that are views (FP8 scales) keep their views by themselves."""
    cls = type(layer)
    copied = cls.__new__(cls)
    memo[id(layer)] = copied
    copied.__dict__.update({key: copy.deepcopy(value, memo) for key, value in layer.__dict__.items()})
    for name, stack in (("weight", "weight_stack"), ("bias", "bias_stack")) if rows is not None else ():
        if getattr(copied, stack, None) is not None:
            setattr(copied, name, nn.Parameter(getattr(copied, stack)[rows[0]:rows[1]], requires_grad=False))
    return copied


def _fusable(members: list[nn.Module]) -> bool:
    """Plain Linears (not quantised ones) over one input size, dtype and device, all with or all
    without a bias."""
    if not all(type(m) is nn.Linear for m in members):
        return False
    return same_inputs(members)


def same_inputs(members: list[nn.Module]) -> bool:
    """Linear-like members over one input size, weight dtype and device, all with or all without
    a bias."""
    first = members[0]
    return all(m.in_features == first.in_features and m.weight.dtype == first.weight.dtype
               and m.weight.device == first.weight.device and (m.bias is None) == (first.bias is None)
               for m in members)


def _stack(parent: nn.Module, names: tuple[str, ...]) -> None:
    members = [getattr(parent, n) for n in names]
    with torch.no_grad():
        weights = torch.cat([m.weight for m in members])
        biases = None if members[0].bias is None else torch.cat([m.bias for m in members])
    start = 0
    for name, member in zip(names, members):
        setattr(parent, name, RowsOf(weights, biases, start, start + member.out_features))
        start += member.out_features


def projection_groups(model: nn.Module) -> Iterator[tuple[nn.Module, tuple[str, ...], list[nn.Module]]]:
    """(parent module, member names, members) of every group of `GROUPS` that `model` holds."""
    for module in list(model.modules()):
        for names in GROUPS:
            members = [getattr(module, n, None) for n in names]
            if all(isinstance(m, nn.Module) for m in members):
                yield module, names, members


def fuse_projections(model: nn.Module) -> int:
    """Stack every group of `GROUPS` that `model`'s modules hold as plain Linears, or as layers of
    one class that stacks itself (`stack_group`: FP8 rollout Linears); returns how many groups
    were stacked. Call it after the model is on its device and dtype (`.to` would copy the stack
    and its views apart; a deep copy keeps them together: `copy_with_row_views`)."""
    fused = 0
    for parent, names, members in projection_groups(model):
        if _fusable(members):
            _stack(parent, names)
            fused += 1
        elif len({type(m) for m in members}) == 1 and hasattr(members[0], "stack_group"):
            fused += bool(type(members[0]).stack_group(members))
    return fused


def _key(value):
    """A hashable form of an FX node argument (lists of sizes become tuples)."""
    if isinstance(value, (list, tuple)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    return value


def _pure_ops() -> set:
    """GEMMs, views, and the elementwise ops and reductions of per-row FP8 quantisation
    (algo/fp8.py): none of them mutates or draws random numbers, so two nodes of one op over the
    same inputs compute the same values."""
    aten, prims = torch.ops.aten, torch.ops.prims
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.permute.default, aten.t.default,
            aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
            aten._scaled_mm.default, aten.abs.default, aten.amax.default, aten.clamp.default,
            aten.clamp_min.default, aten.clamp_max.default, aten.div.Tensor, aten.mul.Tensor, aten.gt.Scalar,
            aten.where.self, aten.full.default, aten.scalar_tensor.default, aten._to_copy.default,
            prims.convert_element_type.default}


PURE_OPS = _pure_ops()


class ComputedOnce(CustomGraphPass):
    """Common-subexpression elimination over pure ops (`PURE_OPS`): a node whose operation and
    inputs equal an earlier node's is replaced by that node, so the graph computes the same values
    with one node where there were several."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        seen: dict[tuple, torch.fx.Node] = {}
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target not in PURE_OPS:
                continue
            key = (node.target, _key(node.args), _key(node.kwargs))
            if key in seen:
                node.replace_all_uses_with(seen[key])
                graph.erase_node(node)
            else:
                seen[key] = node

    def uuid(self) -> str:
        return "k3post.ComputedOnce.v2"


def step_compile_options() -> dict:
    """torch.compile options of a sampler's compiled steps: "reduce-overhead"'s CUDA graphs, and
    the pass that computes a fused group's GEMM once."""
    return {"triton.cudagraphs": True, "post_grad_custom_pre_pass": ComputedOnce()}
