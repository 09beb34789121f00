"""Did every sampler get the learner's weights? Checksums of a few tensors after each sync.

A weight sync moves every tensor of the student from the learner to each sampler replica (Ray's
object store, a broadcast group, CUDA IPC, or a direct copy in one process). A bug or a fault on
that path - a tensor dropped, sent twice, transposed, read from a buffer the learner already
overwrote, cast or truncated on the way - leaves a sampler drawing from weights the learner never
had, and nothing downstream notices: the importance ratios absorb it as "drift". So after each
push the learner and every sampler checksum the same few tensors and the run stops at the first
difference, naming the tensor, the version and the replica.

The checksum of a tensor is a hash of its bytes, in integer arithmetic. Each element's bits are
read as a signed integer b_i of the element's width (a float32 as an int32, a bf16 as an int16),
and, modulo 2^m (m = 32, or 64 for 8-byte elements):

    plain    = Σ_i b_i
    weighted = Σ_i b_i · w_i,   w_i = 2 · ((40503 · i) mod 2^16) + 1

Integer sums are exact and do not depend on the order of the additions, so the two sides agree
to the bit whatever device, kernel or thread count summed them (a float sum would need a
tolerance, and a tolerance loose enough for float32 rounding would miss stale weights after a
small step: at lr 1e-6 the sum of a tensor moves by ~1e-8 of its magnitude). `plain` changes
with any single changed element (a change of b_i by d changes the sum by d ≠ 0 mod 2^m);
`weighted` also sees values moved to other positions - a transpose, a permutation, a shifted
copy - which leave `plain` unchanged: w is odd (invertible mod 2^m) and differs between
neighbours, and repeats only every 2^16 positions (a move by a multiple of 2^16 is not seen).
Equal bit patterns agree, NaNs included.

Cost: one integer column-sum per element of the checked tensors (see `checksum`), on each side
(bench/weight_check_cost.py, docs/benchmarks.md).

Which tensors: `checked_names(names, version, per_sync)` takes `per_sync` consecutive names of the
sorted list, starting at `version · per_sync` (wrapping), so every tensor is checked once every
⌈len(names) / per_sync⌉ syncs, and both sides pick the same ones from the version alone.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from k3post.config.errors import RunStopped

CHECKED_PER_SYNC = 4  # tensors checked after each sync (the quickstart's student has 218: all within 55 syncs)
CHUNK = 2**20  # elements summed at once (a multiple of PERIOD; bounds the widening of 16-bit elements)
PERIOD = 2**16  # the index weights repeat with this period
_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Checksum:
    shape: tuple[int, ...]
    dtype: str
    plain: int  # unsigned, mod 2^32 (2^64 for 8-byte elements)
    weighted: int

    def agrees_with(self, other: "Checksum") -> bool:
        return self == other


class WeightSyncMismatch(RunStopped):
    """A sampler's weights differ from the learner's after a sync: the run stops at once (its
    samples would come from a policy the learner never had). Re-running resumes from the last
    checkpoint."""


_WEIGHTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _index_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """w over one period: w_i depends on i mod 2^16 only (40503 · 2^16 ≡ 0 mod 2^16), and as 40503
    is odd, i ↦ 40503·i mod 2^16 permutes each period, so neighbours get unrelated weights."""
    key = (device, dtype)
    if key not in _WEIGHTS:
        index = torch.arange(PERIOD, dtype=torch.int64, device=device)
        _WEIGHTS[key] = (2 * ((index * 40503) % PERIOD) + 1).to(dtype)
    return _WEIGHTS[key]


def _as_torch(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():  # read-only arrays from Ray's object store: only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(value))


@torch.no_grad()
def checksum(value: torch.Tensor | np.ndarray) -> Checksum:
    """(plain, weighted) integer sums of a tensor's bit patterns, on the tensor's own device.

    w being periodic, weighted = Σ_k w_k · c_k with c_k = Σ_{i ≡ k mod 2^16} b_i: the column sums
    of the bits viewed as rows of 2^16, and plain = Σ_k c_k. So each element is read once, by one
    column-sum reduction (elements narrower than 4 bytes widened to int32 a block at a time). The
    sums wrap modulo 2^32 (2^64), as integer tensors do on CPUs and GPUs: the arithmetic the
    definition asks for."""
    t = _as_torch(value)
    bits = t.detach().contiguous().reshape(-1).view(_SIGNED[t.element_size()])
    acc = torch.int64 if t.element_size() == 8 else torch.int32
    columns = torch.zeros(PERIOD, dtype=acc, device=bits.device)
    body = bits.numel() - bits.numel() % PERIOD
    rows = bits[:body].view(-1, PERIOD)
    for start in range(0, rows.shape[0], CHUNK // PERIOD):
        columns += rows[start:start + CHUNK // PERIOD].to(acc).sum(0, dtype=acc)
    columns[: bits.numel() - body] += bits[body:].to(acc)
    modulus = 2 ** (8 * columns.element_size())
    plain = int(columns.sum(dtype=acc)) % modulus
    weighted = int((columns * _index_weights(bits.device, acc)).sum(dtype=acc)) % modulus
    return Checksum(tuple(t.shape), str(t.dtype).removeprefix("torch."), plain, weighted)


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
            found = "nothing" if have is None else f"{have.dtype} {have.shape}, checksums {have.plain:#x}/{have.weighted:#x}"
            raise WeightSyncMismatch(
                f"weight sync v{version}: sampler replica {replica} does not hold the learner's '{name}' "
                f"(learner: {want.dtype} {want.shape}, checksums {want.plain:#x}/{want.weighted:#x}; "
                f"sampler: {found}); its samples would come from weights the learner never had, so the run "
                f"stops (re-run the same command to resume from the last checkpoint)")


def check_replicas(expected: dict[str, Checksum], per_replica: list[dict[str, Checksum]], version: int) -> None:
    """`check_sync` for every sampler replica, in replica order."""
    for replica, got in enumerate(per_replica):
        check_sync(expected, got, version, replica)
