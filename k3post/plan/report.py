"""`k3post plan`'s output: the recipe's groups, their memory, the layout and a verdict per device.

`make_plan` puts the parts together (groups.py → placement.py → verdict.py); `render` turns the
result into the text the command prints: one table of what one actor of each group needs (part
by part), one table of every GPU (or node's host memory) with its tenants and verdict, and the
fixes for each device that does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from k3post.plan.groups import GroupNeed, Lengths, group_needs, step_lengths
from k3post.plan.memory import GIB
from k3post.plan.placement import Cluster, Layout, place
from k3post.plan.verdict import (CONTEXT, HOST_PROCESS, SLACK, device_use, footprint, host_footprint, learner_fixes,
                                 serving_fixes)


@dataclass
class DeviceVerdict:
    where: str  # "node 0 GPU 3", "node 0 host"
    tenants: list[str]
    used: float
    capacity: float | None
    fixes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.capacity is None or self.used <= self.capacity


@dataclass
class Plan:
    cluster: Cluster
    host_bytes: float | None
    lengths: Lengths
    groups: list[GroupNeed]
    layout: Layout
    devices: list[DeviceVerdict]

    @property
    def fits(self) -> bool:
        return not self.layout.unplaced and all(d.fits for d in self.devices)


def _per_gpu(group: GroupNeed) -> float:
    """Bytes one actor of the group puts on each GPU it holds (a vLLM engine over several GPUs
    reserves its fraction of each)."""
    if group.vllm_fraction:
        return group.need.total / max(1, int(group.num_gpus)) if group.num_gpus >= 1 else group.need.total
    return group.need.total


PERSISTENT = ("weights", "gradients", "optimizer", "reference", "draft head", "samplers' copy", "KV cache",
              "vLLM reservation")


def in_process_use(groups: list[GroupNeed]) -> float:
    """One process holding every engine (`k3post run --in-process`, `ray.in_process`): the engines
    run one after another, so the peak is every engine's persistent parts (weights, optimizer
    state, a copy reference, KV caches) plus the largest transient of any one of them; of the
    vLLM engines in sleep mode only the largest counts (they take turns), each with the CUDA
    context of its engine core's own process."""
    def held(g: GroupNeed) -> float:
        return g.replicas * sum(g.need.parts.get(p, 0.0) for p in PERSISTENT)

    persistent = sum(held(g) for g in groups if not g.sleeps)
    persistent += max((held(g) for g in groups if g.sleeps), default=0.0)  # sleeping engines take turns
    transient = max(sum(v for k, v in g.need.parts.items() if k not in PERSISTENT) for g in groups)
    return (persistent + transient) * SLACK + CONTEXT * (1 + sum(g.sleeps for g in groups))


def in_process_plan(recipe: Any, cluster: Cluster, lengths: Lengths, groups: list[GroupNeed],
                    host_bytes: float | None) -> Plan:
    on_gpu = recipe.resources.learner.num_gpus > 0
    tenants = [f"{g.key}[{i}]" for g in groups for i in range(g.replicas)]
    used = in_process_use(groups) if on_gpu else in_process_use(groups) - CONTEXT + HOST_PROCESS
    where = "node 0 GPU 0 (one process)" if on_gpu else "node 0 host memory (one process)"
    devices = [DeviceVerdict(where, tenants, used, cluster.gpu_bytes if on_gpu else host_bytes)]
    pinned = {f"{g.key}[{i}]": g.need.host_pinned for g in groups for i in range(g.replicas) if g.need.host_pinned}
    if on_gpu and pinned:
        devices.append(_host_verdict(0, [], pinned, host_bytes))
    return Plan(cluster, host_bytes, lengths, groups, Layout([], [], {g.key: [0] * g.replicas for g in groups}),
                devices)


def make_plan(recipe: Any, cluster: Cluster, prompt_tokens: int | None = None, host_bytes: float | None = None,
              shapes: dict | None = None, in_process: bool = False) -> Plan:
    lengths = step_lengths(recipe, prompt_tokens)
    groups = group_needs(recipe, lengths, cluster.gpu_bytes, shapes)
    if in_process or recipe.ray.in_process:
        return in_process_plan(recipe, cluster, lengths, groups, host_bytes)
    by_key = {g.key: g for g in groups}
    resources = {"learner": recipe.resources.learner, "samplers": getattr(recipe.resources, "samplers", None)}
    entries = []
    for g in groups:
        res = resources.get(g.key) or _resources_of(recipe, g.key)
        entries.append((g.key, res, _per_gpu(g)))
    layout = place(entries, cluster, getattr(recipe.resources, "placement", None), recipe.learner.placement)
    vllm = {g.key for g in groups if g.vllm_fraction}
    sleeping = frozenset(g.key for g in groups if g.sleeps)
    devices = []
    for d in layout.devices:
        if not d.tenants:
            continue
        used = device_use(d, vllm, sleeping)
        verdict = DeviceVerdict(f"node {d.node} GPU {d.index}", [t for t, _ in d.tenants], used, cluster.gpu_bytes)
        if not verdict.fits:
            verdict.fixes = _fixes(recipe, lengths, by_key, d, used, cluster.gpu_bytes)
        devices.append(verdict)
    pinned = _pinned_by_node(layout, by_key)
    for node in sorted(set(layout.host) | set(pinned)):
        devices.append(_host_verdict(node, layout.host.get(node, []), pinned.get(node, {}), host_bytes))
    return Plan(cluster, host_bytes, lengths, groups, layout, devices)


def _host_verdict(node: int, cpu_actors: list[tuple[str, float]], pinned: dict[str, float],
                  host_bytes: float | None) -> DeviceVerdict:
    """A node's host memory: its CPU actors (with slack and their processes) and the pinned host
    memory of its GPU actors (a sleeping vLLM engine's weights, the gradient-buffer reference's
    copy), by actor label."""
    used = sum(host_footprint(b) for _, b in cpu_actors) + sum(pinned.values())
    tenants = [t for t, _ in cpu_actors] + [f"{t} (pinned)" for t in pinned]
    return DeviceVerdict(f"node {node} host memory", tenants, used, host_bytes)


def _pinned_by_node(layout: Layout, groups: dict[str, GroupNeed]) -> dict[int, dict[str, float]]:
    """Per node, the pinned host memory of the GPU actors placed there, by actor label (an actor
    over several GPUs counts once)."""
    pinned: dict[int, dict[str, float]] = {}
    for device in layout.devices:
        for label, _ in device.tenants:
            need = groups[label.rsplit("[", 1)[0]].need
            if need.host_pinned:
                pinned.setdefault(device.node, {})[label] = need.host_pinned
    return pinned


def _resources_of(recipe: Any, key: str) -> Any:
    kind, name = key.split("/", 1)
    return recipe.teachers[name].resources if kind == "teacher" else recipe.reward_models[name].resources


def _fixes(recipe: Any, lengths: Lengths, groups: dict[str, GroupNeed], device, used: float,
           capacity: float) -> list[str]:
    fixes: list[str] = []
    for label, need in device.tenants:
        key = label.rsplit("[", 1)[0]
        group = groups[key]
        others = used - footprint(need, bool(group.vllm_fraction))
        if key == "learner":
            found = learner_fixes(recipe, lengths, group, capacity - others)
            fixes += found or ["the learner rank does not fit even with the changes tried; a GPU with more memory"]
        elif not group.vllm_fraction:
            spec = recipe.teachers[key.split("/", 1)[1]].model if key.startswith("teacher/") else recipe.student
            fixes += serving_fixes(group, capacity - others, 2 if spec.dtype == "bfloat16" else 4)
        else:
            fixes.append(f"{key}: lower its vllm.gpu_memory_utilization or give it a GPU of its own")
    return list(dict.fromkeys(fixes))


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def _group_rows(plan: Plan) -> list[str]:
    parts = ["weights", "gradients", "optimizer", "gathered weights", "activations", "LM head", "gradient reduction",
             "reference", "FP8 QAT", "draft head", "samplers' copy", "scoring forward", "full-vocab output",
             "KV cache", "prefill", "weight-sync bucket", "vLLM reservation"]
    used = [p for p in parts if any(g.need.parts.get(p) for g in plan.groups)]
    head = ["group", "actors", "GPUs each", *used, "peak GiB", "pinned host GiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for g in plan.groups:
        cells = [g.key, str(g.replicas), f"{g.num_gpus:g}", *[gib(g.need.parts.get(p, 0.0)) for p in used],
                 gib(g.need.total), gib(g.need.host_pinned)]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render(plan: Plan, label: str) -> list[str]:
    c = plan.cluster
    gpus = f"{c.gpus_per_node} GPUs of {gib(c.gpu_bytes)} GiB" if c.gpus_per_node else "no GPUs"
    lines = [f"k3post plan: {label}",
             f"cluster: {c.nodes} node{'s' if c.nodes > 1 else ''} × {gpus}"
             + (f", {gib(plan.host_bytes)} GiB host memory per node" if plan.host_bytes else ""),
             f"step: {plan.lengths.rows} rows of at most {plan.lengths.prompt} prompt + {plan.lengths.new_tokens} "
             f"new tokens", "", "What one actor of each group needs (GiB; peaks of allocated memory):", ""]
    lines += _group_rows(plan)
    lines += [""] + [f"- {g.key}: {note}" for g in plan.groups for note in g.notes]
    lines += ["", "Where they land and whether they fit (each GPU tenant + 5% allocator slack + 0.6 GiB CUDA "
              "context; vLLM: its reservation; a CPU actor + 5% + 1 GiB for its process; a GPU actor's pinned host "
              "memory as it is):", "",
              "| device | actors | needs GiB | has GiB | verdict |",
              "|---|---|---|---|---|"]
    for d in plan.devices:
        has = gib(d.capacity) if d.capacity is not None else "-"
        verdict = "fits" if d.fits and d.capacity is not None else "not checked" if d.capacity is None else \
            f"SHORT by {gib(d.used - d.capacity)} GiB"
        lines.append(f"| {d.where} | {', '.join(d.tenants)} | {gib(d.used)} | {has} | {verdict} |")
    for name in plan.layout.unplaced:
        lines.append(f"| - | {name} | - | - | NO ROOM: no node has the GPUs it asks for |")
    for d in plan.devices:
        if d.fixes:
            lines += ["", f"{d.where} would fit with any one of:"] + [f"  {f}" for f in d.fixes]
    lines += ["", "verdict: " + ("fits" if plan.fits else "does NOT fit (see above)")]
    return lines
