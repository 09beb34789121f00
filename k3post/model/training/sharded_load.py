"""Loading a student straight into its FSDP2 shards: no rank holds the whole model in fp32.

For a model directory (a Hugging Face path, the builtin SmolLM2, a converted GGUF):
1. build the module tree with every *parameter* on the meta device (no memory); buffers stay
   real, so non-persistent ones computed in `__init__` (rotary `inv_freq`) keep their values;
2. apply what changes the module tree (`prepare`: FP8 QAT) and `shard` (fully_shard);
3. allocate each rank's shards (`to_empty`) and read into them, from the safetensors files,
   only this rank's rows of each tensor (`safe_open(...).get_slice(name)[start:stop]`), cast
   to the master dtype as they land.

A rank's host memory therefore peaks near its shard plus one tensor's slice, not the model.
Random students (tiny, kimi) and layer-pruned ones (`keep_layers`) are built whole by
`load_model` and sharded afterwards: they are small by design, or built once per run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from k3post.config.schema import ModelSpec
from k3post.model.training.fsdp import FSDPRoot
from k3post.model.loading.load import load_model, load_tokenizer, model_directory


def parameters_on_meta():
    """Modules built inside get their parameters on the meta device (buffers stay real):
    accelerate's `init_empty_weights`, buffers excluded explicitly (its default reads an env var).

    Parameter constructors still call `torch.empty` on the host (untouched pages, no RSS); the
    registration moves each to meta before any initialiser writes it, keeping the parameter's
    class and the attributes transformers sets on it (`_is_hf_initialized`)."""
    from accelerate import init_empty_weights  # noqa: PLC0415 - only where a model is built on meta

    return init_empty_weights(include_buffers=False)


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded checkpoints have an index)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            out.update(dict.fromkeys(f.keys(), file))
    return out


def shard_rows(global_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """FSDP2's Shard(0) split (torch.chunk): ceil(n / world) rows per rank, the last ones short
    or empty."""
    per = -(-global_rows // world_size)
    start = min(rank * per, global_rows)
    return start, min(start + per, global_rows)


def _read_local(file_handles: dict, files: dict[str, Path], name: str, target: torch.Tensor,
                rank: int, world_size: int) -> torch.Tensor:
    path = files[name]
    if path not in file_handles:
        file_handles[path] = safe_open(path, framework="pt")
    view = file_handles[path].get_slice(name)
    shape = view.get_shape()
    if isinstance(target, DTensor):
        start, stop = shard_rows(shape[0], rank, world_size) if shape else (0, 0)
        return view[start:stop] if shape else view[:]
    return view[:]


@torch.no_grad()
def _fill_from_files(model: nn.Module, directory: Path, rank: int, world_size: int) -> None:
    files, handles = _tensor_files(directory), {}
    for name, p in model.named_parameters():
        if name not in files:  # tied weights (lm_head -> embed_tokens) are stored once
            raise KeyError(f"{directory}: no tensor {name!r} in the safetensors files")
        local = p.to_local() if isinstance(p, DTensor) else p
        piece = _read_local(handles, files, name, p, rank, world_size)
        if piece.shape != local.shape:
            raise RuntimeError(f"{name}: read {tuple(piece.shape)} for a local shard of {tuple(local.shape)}")
        local.copy_(piece)
    for name, b in model.named_buffers():
        if name in files:  # persistent buffers saved with the model
            b.copy_(_read_local(handles, files, name, b, rank, world_size))


def _meta_model(directory: Path, dtype: torch.dtype) -> PreTrainedModel:
    config = AutoConfig.from_pretrained(directory)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()
    return model


def load_sharded_model(spec: ModelSpec, dtype: torch.dtype, device: torch.device, rank: int, world_size: int,
                       prepare: Callable[[nn.Module], None], shard: Callable[[nn.Module], FSDPRoot],
                       ) -> tuple[FSDPRoot, PreTrainedTokenizerBase]:
    """The student of `spec` as this rank's FSDP2 shards in `dtype` on `device`, in eval mode
    (the HF model is `root.model`). `prepare` changes the module tree before sharding (QAT);
    `shard` applies FSDP2 and returns the root."""
    directory = model_directory(spec)
    if directory is None or spec.keep_layers is not None:
        model, tokenizer = load_model(spec)
        model = model.to(dtype)
        prepare(model)
        root = shard(model.to(device))
        return root.eval(), tokenizer
    tokenizer = load_tokenizer(spec)
    model = _meta_model(directory, dtype)
    prepare(model)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # to_empty drops their values
    root = shard(model)
    root.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name].to(b.dtype))
    _fill_from_files(model, directory, rank, world_size)
    return root.eval(), tokenizer
