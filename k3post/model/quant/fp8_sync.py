"""The FP8 weight sync: what the learner sends the samplers under `sampling.weights: fp8`.

Once the learner's fake quantisation is on, its forward multiplies by each quantised Linear's
weight on the e4m3 grid, never by the weight itself. So that is what it sends: for every Linear
that model/quant/qat.py fake-quantises,

    <layer>.weight        the e4m3 values q [out, in], as their bytes (uint8)
    <layer>.weight_scale  the fp32 per-row scales s [out, 1]

(algo/fp8.py `quantize_rows`: torchao's rounding, so q·s is the learner's fake-quantised weight
bit for bit; the names are those of the compressed-tensors export, model/export/fp8_export.py), and
every other tensor (embeddings, norms, the LM head, biases) as before. Per quantised Linear that
is out·in + 4·out bytes against 2·out·in in bf16 (4·out·in in fp32): half of bf16's, plus 2/in.

The e4m3 values travel as bytes (a uint8 numpy array on the host, a uint8 tensor on a GPU)
because torch 2.13 cannot unpickle a float8 tensor (Ray's object store pickles every torch
tensor) and gloo has no float8 type; bytes go through every transport, Ray's zero-copy path
included, and the weight check hashes them as they are (engine/transport/weight_check.py reads any 1-byte
element as an int8). The receiving Linear views them as float8_e4m3fn (model/quant/fp8_linear.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from k3post.algo.fp8 import E4M3, quantize_rows

SCALE = "weight_scale"


def scale_name(weight_name: str) -> str:
    """`<layer>.weight` → `<layer>.weight_scale`."""
    return weight_name.removesuffix("weight") + SCALE


def fp8_layers_of(weights: Iterable[str]) -> set[str]:
    """The layers a payload carries in FP8 (those with a scale)."""
    return {name.removesuffix("." + SCALE) for name in weights if name.endswith("." + SCALE)}


def as_e4m3(bits: torch.Tensor | np.ndarray) -> torch.Tensor:
    """The e4m3 values of a payload's bytes (a view, no copy)."""
    t = bits if isinstance(bits, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(bits))
    return t.view(E4M3)


def _to_wire(t: torch.Tensor, keep: dict[str, torch.Tensor] | None, name: str) -> torch.Tensor | np.ndarray:
    """`t` as sent: bytes for e4m3; in the learner's buffer `keep[name]` when one of its shape is
    there (a sync in place: CUDA IPC handles of it stay valid); numpy on the host."""
    if t.dtype == E4M3:
        t = t.view(torch.uint8)
    if keep is not None:
        held = keep.get(name)
        if held is not None and held.shape == t.shape and held.dtype == t.dtype and held.device == t.device:
            t = held.copy_(t)
        else:
            keep[name] = t
    return t.numpy() if t.device.type == "cpu" else t


def fp8_payload(weights: dict[str, torch.Tensor | np.ndarray], layers: Iterable[str],
                keep: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor | np.ndarray]:
    """`weights` with each `<layer>.weight` of `layers` replaced by its e4m3 bytes followed by its
    `weight_scale`, in the same order otherwise; `keep`: the sender's buffers, reused across syncs."""
    quantised = {f"{layer}.weight" for layer in layers}
    out: dict[str, torch.Tensor | np.ndarray] = {}
    for name, value in weights.items():
        if name not in quantised:
            out[name] = value
            continue
        t = value if isinstance(value, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(value))
        with torch.no_grad():
            q, scale = quantize_rows(t.detach())
        out[name] = _to_wire(q, keep, name)
        out[scale_name(name)] = _to_wire(scale, keep, scale_name(name))
    return out


def payload_bytes(weights: dict[str, torch.Tensor | np.ndarray]) -> int:
    """The bytes a sync of `weights` moves (every tensor once)."""
    return sum(int(v.nbytes) if isinstance(v, np.ndarray) else v.numel() * v.element_size() for v in weights.values())
