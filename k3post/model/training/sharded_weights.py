"""Full weights out of a sharded model, a bucket at a time: for samplers and for HF exports.

Every rank takes part in every gather (`DTensor.full_tensor()` is an all-gather); only rank 0
keeps what comes back. Tensors are gathered in buckets of about `bucket_bytes`, and a bucket is
handed on (and dropped) before the next is gathered, so no device ever holds the whole model
at once: the peak is one bucket of full tensors. Each tied storage travels once, under its
first name (as model/training/weights.py does for an unsharded model).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor

DEFAULT_BUCKET_BYTES = 512 * 2**20
HF_SHARD_BYTES = 5 * 2**30  # Hugging Face's default max_shard_size


def _unique_entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """state_dict() entries with every (local) storage under its first name."""
    seen, out = set(), []
    for name, t in model.state_dict().items():
        local = t.to_local() if isinstance(t, DTensor) else t
        key = (local.data_ptr(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            out.append((name, t))
    return out


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _bytes(t: torch.Tensor, dtype: torch.dtype | None) -> int:
    return t.numel() * (dtype or t.dtype).itemsize


def iter_full_buckets(model: nn.Module, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dtype: torch.dtype | None = None,
                      to_host: bool = False) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets of (name, full tensor): yielded on rank 0; the other ranks gather and yield
    empty lists (every rank must run the loop to its end: the gathers are collective).

    `dtype` casts on the way (e.g. fp32 master weights → the samplers' bf16); `to_host`
    copies each full tensor to host memory as soon as it is gathered."""
    bucket, size = [], 0
    for name, t in _unique_entries(model):
        with torch.no_grad():
            full = t.full_tensor() if isinstance(t, DTensor) else t.detach()
        if _rank0():
            full = full.to(dtype) if dtype is not None else full
            bucket.append((name, full.cpu() if to_host else full))
        size += _bytes(t, dtype)
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket or size:
        yield bucket


def gathered_state(model: nn.Module, dtype: torch.dtype | None = None, to_host: bool = True,
                   bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> dict[str, torch.Tensor]:
    """name -> full tensor on rank 0 ({} elsewhere), gathered bucket by bucket."""
    out = {}
    for bucket in iter_full_buckets(model, bucket_bytes, dtype, to_host):
        out.update(bucket)
    return out


def refill_full_state(model: nn.Module, buffers: dict[str, torch.Tensor], dtype: torch.dtype | None = None,
                      prefix: str = "") -> None:
    """A group of one rank holds every shard whole: copy each tensor, cast to `dtype`, into
    `buffers[prefix + name]` on its own device, with no gather. The buffers are made on the
    first call and refilled in place after, so their addresses stay put between syncs (CUDA IPC
    handles made once keep naming them) and the device holds one export copy, never two."""
    for name, t in _unique_entries(model):
        local = t.to_local() if isinstance(t, DTensor) else t
        if tuple(local.shape) != tuple(t.shape):
            raise ValueError(f"{name}: this rank holds {tuple(local.shape)} of {tuple(t.shape)}; only a group of one "
                             f"rank holds its tensors whole")
        out = buffers.get(prefix + name)
        if out is None:
            out = buffers[prefix + name] = torch.empty(t.shape, dtype=dtype or t.dtype, device=local.device)
        with torch.no_grad():
            out.copy_(local)


def save_hf_weights(model: nn.Module, directory: Path, dtype: torch.dtype | None = None,
                    shard_bytes: int = HF_SHARD_BYTES) -> None:
    """Write the model's full weights as HF safetensors from rank 0, a file per `shard_bytes`
    (`model-00001-of-0000N.safetensors` plus `model.safetensors.index.json` when more than
    one), gathering bucket by bucket so rank 0 holds at most one file's tensors on the host."""
    current: dict[str, torch.Tensor] = {}
    size = 0
    names: list[tuple[Path, list[str]]] = []  # the parts written so far and their tensors
    for bucket in iter_full_buckets(model, min(shard_bytes, DEFAULT_BUCKET_BYTES), dtype, to_host=True):
        for name, tensor in bucket:
            current[name] = tensor.contiguous()
            size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            _flush(directory, current, names)
            current, size = {}, 0
    if not _rank0():
        return
    if current or not names:
        _flush(directory, current, names)
    _name_files(directory, names)


def _flush(directory: Path, tensors: dict[str, torch.Tensor], names: list) -> None:
    """Write one numbered part now (its tensors then leave memory) and note what it holds."""
    path = directory / f".part-{len(names):05d}.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    names.append((path, list(tensors)))


def _name_files(directory: Path, names: list) -> None:
    """Give the parts HF's names (one file: model.safetensors; several: numbered + index)."""
    if len(names) == 1:
        names[0][0].rename(directory / "model.safetensors")
        return
    weight_map, total = {}, 0
    for i, (path, keys) in enumerate(names):
        final = f"model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        path.rename(directory / final)
        weight_map.update(dict.fromkeys(keys, final))
        total += (directory / final).stat().st_size
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
