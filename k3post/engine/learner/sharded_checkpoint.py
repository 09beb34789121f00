"""Checkpoints that reshard on resume: a sharded learner's, written atomically across ranks,
and the model + optimizer state (`dcp/`) that the one-process learner writes too.

A checkpoint directory holds
- `dcp/`: the model and optimizer state through `torch.distributed.checkpoint`, each rank
  writing its own shards (in parallel) plus rank 0's metadata. DCP stores every tensor with its
  global shape and offsets, so a group of any size can load it: 2 ranks → 1, 1 → 2, and the
  one-process `Learner` (plain tensors, no process group) ↔ a group. The keys are the Hugging
  Face parameter names (`get_state_dict` of the HF model, inside the FSDP root on a rank), the
  optimizer state keyed by them too, so both learners agree on every key;
- the Hugging Face export (gathered bucket by bucket, written by rank 0; several safetensors
  files with an index when large) with `config.json` and the tokenizer, which `from_pretrained`,
  `k3post export-fp8` and vLLM load;
- what every rank adds (`write_all`: a draft head's own `mtp_dcp/`, engine/learner/draft_trainer.py)
  and what rank 0 adds (`write_rank0`: scheduler, RNG, the driver's run state) and `COMPLETE`.

Atomicity is track/atomic.py's contract, across ranks: rank 0 opens the hidden temporary
directory and tells every rank its path; all write into it; rank 0 renames it into place only
after every rank's writes are done. A crash of any rank before the rename leaves the previous
checkpoint as it was. Ranks on several nodes need the run directory on storage they all share:
each writes its shards where *it* sees the path, so rank 0 checks that every shard file DCP's
metadata lists is in its own view before it publishes (`check_shards_here`), and a run directory
local to each node fails there, naming it, instead of publishing a checkpoint that cannot load.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from k3post.config.errors import UserError
from k3post.model.training.sharded_weights import save_hf_weights
from k3post.track.atomic import atomic_directory, mark_complete

DCP_DIR = "dcp"


def _share_path(path: Path | None) -> Path:
    """Rank 0's `path`, on every rank."""
    box = [str(path) if path is not None else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def check_shards_here(directory: Path) -> None:
    """Every shard file that DCP's metadata in each DCP directory of `directory` (`dcp/`, and a
    draft head's `mtp_dcp/`) lists is there as this process sees it (UserError naming the missing
    ones otherwise)."""
    for metadata in sorted(Path(directory).glob("*/.metadata")):
        _check_shards(metadata.parent, Path(directory))


def _check_shards(state: Path, directory: Path) -> None:
    listed = {info.relative_path for info in dcp.FileSystemReader(str(state)).read_metadata().storage_data.values()}
    missing = sorted(name for name in listed if not (state / name).is_file())
    if missing:
        raise UserError(f"{Path(directory).parent.parent}: the learner's ranks wrote checkpoint shards that rank 0 "
                        f"does not see ({', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} missing from "
                        f"{state}): with ranks on several nodes the run directory must be on storage every node "
                        f"mounts at the same path (--run-dir /shared/...; cluster/shared-storage.yaml)")


def has_state(directory: Path) -> bool:
    """Whether `directory` holds model + optimizer state in DCP's layout."""
    return (Path(directory) / DCP_DIR).is_dir()


def save_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, distributed: bool,
               subdir: str = DCP_DIR) -> None:
    """Model (the HF model, sharded or not) and optimizer into `directory/<subdir>/` (`dcp/`). Not
    `distributed`: one process, no collectives, whatever process group the process may hold
    (an in-process vLLM engine owns one)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(Path(directory) / subdir),
                 no_dist=not distributed)


def _write(tmp: Path, model: nn.Module, optimizer: torch.optim.Optimizer, hf_dtype: torch.dtype | None) -> None:
    save_state(tmp, model, optimizer, distributed=True)
    save_hf_weights(model, tmp, dtype=hf_dtype)
    _barrier()  # every rank's shard files are written before rank 0 publishes the directory


def save_sharded_checkpoint(final: Path, model: nn.Module, optimizer: torch.optim.Optimizer,
                            write_rank0: Callable[[Path], None], hf_dtype: torch.dtype | None = None,
                            write_all: Callable[[Path], None] | None = None) -> None:
    """Called on every rank with the HF model (the FSDP root's `.model`). `write_all(tmp)` runs
    on every rank (collective writes: a draft head's); `write_rank0(tmp)` adds rank 0's files
    (config, tokenizer, trainer state); every rank returns once the checkpoint is published."""
    def write_shards(tmp: Path) -> None:
        _write(tmp, model, optimizer, hf_dtype)
        if write_all is not None:
            write_all(tmp)
            _barrier()

    if not dist.is_initialized() or dist.get_rank() == 0:
        with atomic_directory(Path(final)) as tmp:
            _share_path(tmp)
            write_shards(tmp)
            check_shards_here(tmp)
            write_rank0(tmp)
            mark_complete(tmp)
    else:
        write_shards(_share_path(None))
    _barrier()


@torch.no_grad()
def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state tensors (for DCP to load into) by one step at lr 0 on
    zero gradients. torch's own initialiser skips optimizers whose params already have grads —
    the grad-buffer reference's buffers — and loads nothing; it would also free them."""
    if optimizer.state:
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.zero_()
    lrs = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs):
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=False)


def load_state(directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, distributed: bool,
               subdir: str = DCP_DIR) -> None:
    """Load model and optimizer from `directory/<subdir>/` (`dcp/`) for this group's layout (one
    process or a group of any size), whatever layout wrote them. The gradient buffers are zero
    afterwards."""
    path = Path(directory) / subdir
    if not path.is_dir():
        raise UserError(f"{directory}: no model + optimizer state ({DCP_DIR}/): this checkpoint was written by a "
                        f"one-process learner before checkpoints carried {DCP_DIR}/ (or with LoRA), and only one "
                        f"unsharded learner rank can resume it; resume with resources.learner.replicas: 1 and "
                        f"learner.sharding: auto (precision the student's dtype) for one more checkpoint, then "
                        f"change the ranks")
    _init_optimizer_state(optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(state, checkpoint_id=str(path), no_dist=not distributed)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
