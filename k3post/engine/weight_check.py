"""Did every sampler get the learner's weights? Checksums of a few tensors after each sync.

A weight sync moves every tensor of the student from the learner to each sampler replica (Ray's
object store, a broadcast group, CUDA IPC, or a direct copy in one process). A bug or a fault on
that path - a tensor dropped, sent twice, transposed, read from a buffer the learner already
overwrote, cast or truncated on the way - leaves a sampler drawing from weights the learner never
had, and nothing downstream notices: the importance ratios absorb it as "drift". So after each
push the learner and every sampler checksum the same few tensors and the run stops at the first
difference, naming the tensor, the version and the replica.

The checksum of a tensor x (flattened, n elements, in float64):

    plain    = Σ_i x_i
    weighted = Σ_i x_i · w_i,   w_i = ((i · 40503) mod 2^16 + 1) / 2^16  ∈ (0, 1]
    l1       = Σ_i |x_i|

`plain` catches a changed value; `weighted` (index-dependent, non-monotone weights) also catches
values moved to other positions - a transpose, a permutation, a shifted copy - which leave the
plain sum unchanged; `l1` scales the tolerance. The two sides compute the same sums over the same
values, usually on the same kind of device in the same order, so they agree to the bit; across
devices the float64 rounding differs by about log2(n)·2^-53·l1, far below the 1e-12·l1 allowed.
A corrupted element shows unless its change is below 1e-12 of the tensor's l1 norm.

Which tensors: `checked_names(names, version, per_sync)` takes `per_sync` consecutive names of the
sorted list, starting at `version · per_sync` (wrapping), so every tensor is checked once every
⌈len(names) / per_sync⌉ syncs, and both sides pick the same ones from the version alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from k3post.config.errors import RunStopped

CHECKED_PER_SYNC = 4  # tensors checked after each sync (a SmolLM2-135M has 272: all within 68 syncs)
CHUNK = 2**20  # elements summed at once: bounds the float64 and index buffers to ~24 MB
RELATIVE_TOLERANCE = 1e-12


@dataclass(frozen=True)
class Checksum:
    shape: tuple[int, ...]
    plain: float
    weighted: float
    l1: float

    def agrees_with(self, other: "Checksum") -> bool:
        if self.shape != other.shape:
            return False
        tolerance = RELATIVE_TOLERANCE * max(self.l1, other.l1)
        return all(a == b or abs(a - b) <= tolerance  # NaN agrees with nothing: a NaN weight is a finding
                   for a, b in ((self.plain, other.plain), (self.weighted, other.weighted)))


class WeightSyncMismatch(RunStopped):
    """A sampler's weights differ from the learner's after a sync: the run stops at once (its
    samples would come from a policy the learner never had). Re-running resumes from the last
    checkpoint."""


@torch.no_grad()
def checksum(value: torch.Tensor | np.ndarray) -> Checksum:
    """(plain, weighted, l1) sums of a tensor's values in float64, on the tensor's own device."""
    t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
    flat = t.detach().reshape(-1)
    plain = weighted = l1 = torch.zeros((), dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), CHUNK):
        x = flat[start:start + CHUNK].to(torch.float64)
        index = torch.arange(start, start + x.numel(), device=flat.device, dtype=torch.int64)
        w = ((index * 40503) % 65536 + 1).to(torch.float64) / 65536
        plain, weighted, l1 = plain + x.sum(), weighted + (x * w).sum(), l1 + x.abs().sum()
    return Checksum(tuple(t.shape), plain.item(), weighted.item(), l1.item())


def checked_names(names: list[str], version: int, per_sync: int = CHECKED_PER_SYNC) -> list[str]:
    """The tensors checked after sync `version`: a window of the sorted names that moves on by
    `per_sync` every version, so all are covered every ⌈len(names)/per_sync⌉ versions."""
    ordered = sorted(names)
    if not ordered or per_sync <= 0:
        return []
    count = min(per_sync, len(ordered))
    start = (version * count) % len(ordered)
    return [ordered[(start + i) % len(ordered)] for i in range(count)]


def syncs_to_cover(n_names: int, per_sync: int = CHECKED_PER_SYNC) -> int:
    return math.ceil(n_names / max(1, min(per_sync, n_names))) if n_names else 0


def checksums_of(weights: dict[str, torch.Tensor | np.ndarray], names: list[str]) -> dict[str, Checksum]:
    missing = [n for n in names if n not in weights]
    if missing:
        raise KeyError(f"no tensor named {missing[:3]} to checksum")
    return {name: checksum(weights[name]) for name in names}


def check_sync(expected: dict[str, Checksum], got: dict[str, Checksum], version: int, replica: int) -> None:
    """Raise WeightSyncMismatch at the first tensor whose checksums differ (or that is missing)."""
    for name, want in expected.items():
        have = got.get(name)
        if have is None or not want.agrees_with(have):
            found = "nothing" if have is None else f"shape {have.shape}, sum {have.plain:.10g}, weighted {have.weighted:.10g}"
            raise WeightSyncMismatch(
                f"weight sync v{version}: sampler replica {replica} does not hold the learner's '{name}' "
                f"(learner: shape {want.shape}, sum {want.plain:.10g}, weighted {want.weighted:.10g}; "
                f"sampler: {found}); its samples would come from weights the learner never had, so the run "
                f"stops (re-run the same command to resume from the last checkpoint)")


def check_replicas(expected: dict[str, Checksum], per_replica: list[dict[str, Checksum]], version: int) -> None:
    """`check_sync` for every sampler replica, in replica order."""
    for replica, got in enumerate(per_replica):
        check_sync(expected, got, version, replica)
