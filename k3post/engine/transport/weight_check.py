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
    weighted = Σ_i b_i · w_i,   w_i = a_k · c_r,   i = r · 2^16 + k  (0 ≤ k < 2^16)
    a_k = 2 · ((40503 · k) mod 2^16) + 1          c_r = 2 · h(r) + 1

with h a bijection of the 31-bit integers that scatters its inputs (two xor-shift-multiply rounds,
`_mix31`). Read the tensor as rows of 2^16 elements: a_k weighs the position inside a row, c_r the
row.

Integer sums are exact and do not depend on the order of the additions, so the two sides agree
to the bit whatever device, kernel or thread count summed them (a float sum would need a
tolerance, and a tolerance loose enough for float32 rounding would miss stale weights after a
small step: at lr 1e-6 the sum of a tensor moves by ~1e-8 of its magnitude). `plain` changes
with any single changed element (a change of b_i by d changes the sum by d ≠ 0 mod 2^m).
`weighted` also sees values moved to other positions - a transpose, a permutation, a shifted copy,
a swap of two heads or of the two halves of a fused projection - which leave `plain` unchanged.
Every w_i is odd (a product of odd numbers: invertible mod 2^m), so a single change is seen here
too. A move is seen unless the weight differences it meets cancel against the values mod 2^m:

- inside a row, w_i - w_j = c_r · (a_k - a_l), with c_r odd: k ↦ 40503·k mod 2^16 permutes the
  row, so neighbours get unrelated weights;
- between rows r ≠ s at the same k (a block moved by a multiple of 2^16 elements, e.g. two heads
  of a [4096, 4096] q_proj, 8·2^16 elements each), w_i - w_j = a_k · (c_r - c_s): h scatters the
  row numbers, so c_r - c_s = 2·(h(r) - h(s)) is nonzero mod 2^m (h is a bijection below 2^31)
  and looks random whatever the distance r - s (c_r linear in r would give c_r - c_s the factor
  r - s: a move by 2^j rows would lose j bits).

So the weights have no period below 2^47 elements (a_k are distinct in a row, c_r distinct for
r < 2^31), and a move is missed only when the change it makes to `weighted` - for random-looking
values a random-looking even number - is 0 mod 2^m: about once in 2^(m-1), rather than always
for a whole class of distances as with the period-2^16 weight this replaced (which missed any
block moved by a multiple of 2^16 elements). The hash is no defence against an adversary; it
checks a transport.
Equal bit patterns agree, NaNs included.

Cost: each element is read once, by one pass that multiplies it by a_k and sums rows and totals
(see `checksum`), on each side (bench/engines/weight_check_cost.py, docs/benchmarks.md).

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
CHUNK = 2**20  # elements summed at once on a CPU (a multiple of ROW; bounds the widened copy, in cache)
GPU_CHUNK = 2**26  # on a GPU: fewer, larger kernels (the widened block and its product: 512 MiB)
ROW = 2**16  # the blocked form's row: a_k weighs the position in a row, c_r the row
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
_ROW_WEIGHTS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _in_row_weights(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """a_k over one row: as 40503 is odd, k ↦ 40503·k mod 2^16 permutes the row, so neighbours get
    unrelated weights (all odd, below 2^17)."""
    key = (device, dtype)
    if key not in _WEIGHTS:
        index = torch.arange(ROW, dtype=torch.int64, device=device)
        _WEIGHTS[key] = (2 * ((index * 40503) % ROW) + 1).to(dtype)
    return _WEIGHTS[key]


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """h: a bijection of the 31-bit integers (int64 tensors holding 0 ≤ x < 2^31) whose nearby
    inputs give unrelated outputs (the shape of C. Wellons' two-round "hash prospector" function,
    on 31 bits). Each step is invertible mod 2^31: x ^ (x >> s) gives back x's high bits first,
    then the rest; an odd multiplier is a unit mod 2^31. Products stay below 2^62: no overflow."""
    mask = 2**31 - 1
    x = x & mask
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & mask
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & mask
    return x ^ (x >> 15)


def _row_weights(rows: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """c_r = 2·h(r) + 1 for r < rows, as `dtype` integers congruent mod 2^m (for int32: the
    residue mod 2^32 brought into the signed range, so the cast does not depend on the device).
    c_r depends on r alone, so one table per device serves every tensor (a prefix of it)."""
    key = (device, dtype)
    if key not in _ROW_WEIGHTS or _ROW_WEIGHTS[key].numel() < rows:
        c = 2 * _mix31(torch.arange(max(rows, 1024), dtype=torch.int64, device=device)) + 1  # odd, < 2^32
        if dtype == torch.int32:
            c = (c + 2**31) % 2**32 - 2**31
        _ROW_WEIGHTS[key] = c.to(dtype)
    return _ROW_WEIGHTS[key][:rows]


def _as_torch(value: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    with warnings.catch_warnings():  # read-only arrays from Ray's object store: only read here
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.ascontiguousarray(value))


def _row_sums(rows: torch.Tensor, a: torch.Tensor, c: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ b, Σ_r c_r · Σ_k a_k · b_{r,k}) over whole rows [R, 2^16], `step` rows at a time, in the
    accumulator's dtype (that of `a`). The widened block and its product by a go into two buffers
    allocated once: a fresh allocation per block costs more than the arithmetic on a CPU."""
    acc = a.dtype
    plain = torch.zeros((), dtype=acc, device=rows.device)
    weighted = torch.zeros((), dtype=acc, device=rows.device)
    size = min(step, rows.shape[0])
    wide = torch.empty((size, ROW), dtype=acc, device=rows.device) if rows.dtype != acc else None
    product = torch.empty((size, ROW), dtype=acc, device=rows.device)
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        n = block.shape[0]
        if wide is not None:
            block = wide[:n].copy_(block)
        plain += block.sum(dtype=acc)
        torch.mul(block, a, out=product[:n])
        weighted += (product[:n].sum(1, dtype=acc) * c[start:start + n]).sum(dtype=acc)
    return plain, weighted


@dataclass(frozen=True)
class _Pending:
    """A checksum whose two sums are still on the tensor's device (read with `_settle`)."""
    shape: tuple[int, ...]
    dtype: str
    sums: torch.Tensor  # [2]: plain, weighted, in the accumulator's dtype
    modulus: int


@torch.no_grad()
def _pending(value: torch.Tensor | np.ndarray) -> _Pending:
    """(plain, weighted) integer sums of a tensor's bit patterns, on the tensor's own device.

    With the bits viewed as rows of 2^16 (the last one partial), weighted = Σ_r c_r · d_r where
    d_r = Σ_k a_k · b_{r,k}: each block of rows is widened to the accumulator (int32, int64 for
    8-byte elements), multiplied by a, and summed along the rows (d) and in total (plain); the
    d_r are then weighed by c_r. The sums wrap modulo 2^32 (2^64), as integer tensors do on CPUs
    and GPUs: the arithmetic the definition asks for. Nothing is read back to the host here, so
    many tensors' sums are queued on a GPU before one transfer reads them all (`checksums`)."""
    t = _as_torch(value)
    bits = t.detach().contiguous().reshape(-1).view(_SIGNED[t.element_size()])
    acc = torch.int64 if t.element_size() == 8 else torch.int32
    a = _in_row_weights(bits.device, acc)
    c = _row_weights(-(-bits.numel() // ROW), bits.device, acc)
    body = bits.numel() - bits.numel() % ROW
    step = (GPU_CHUNK if bits.is_cuda else CHUNK) // ROW  # the sums do not depend on it
    plain, weighted = _row_sums(bits[:body].view(-1, ROW), a, c, step)
    if body < bits.numel():
        tail = bits[body:].to(acc)
        plain += tail.sum(dtype=acc)
        weighted += (tail * a[: tail.numel()]).sum(dtype=acc) * c[-1]
    return _Pending(tuple(t.shape), str(t.dtype).removeprefix("torch."), torch.stack([plain, weighted]),
                    2 ** (8 * plain.element_size()))


def _settle(pending: list[_Pending]) -> list[Checksum]:
    """Read the sums back: one transfer per device (int32 sums widen to int64 exactly)."""
    values: dict[int, list[int]] = {}
    for device in {p.sums.device for p in pending}:
        mine = [i for i, p in enumerate(pending) if p.sums.device == device]
        read = torch.stack([pending[i].sums.to(torch.int64) for i in mine]).tolist()
        values.update(zip(mine, read))
    return [Checksum(p.shape, p.dtype, values[i][0] % p.modulus, values[i][1] % p.modulus)
            for i, p in enumerate(pending)]


def checksum(value: torch.Tensor | np.ndarray) -> Checksum:
    """The checksum of one tensor (module docstring)."""
    return _settle([_pending(value)])[0]


def checksums(values: dict[str, torch.Tensor | np.ndarray]) -> dict[str, Checksum]:
    """The checksums of many tensors, read back from each device at once: on a GPU a per-tensor
    read would wait for that tensor's kernels, hundreds of times a sync."""
    return dict(zip(values, _settle([_pending(v) for v in values.values()])))


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
    return checksums({name: weights[name] for name in names})


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
