"""Small helpers shared by the engines."""

from __future__ import annotations

import os

import torch

from k3post.config.errors import UserError
from k3post.config.schema import ResourceSpec


def set_threads(num_threads: int | None) -> None:
    """Use `num_threads` intra-op threads (None: every core of the machine).

    The phases of a synchronous OPD step (sample, score, train) run one after another, so by
    default each engine may use the whole machine; Ray's OMP_NUM_THREADS=1 would waste it.
    """
    torch.set_num_threads(max(1, num_threads or os.cpu_count() or 1))


def engine_device(resources: ResourceSpec) -> str:
    """Where an engine computes: "cuda" when its resource spec asks for a GPU, else "cpu".

    Under Ray the actor sees only the GPUs it was given, so "cuda" is its own; in process,
    every engine that asks for a GPU shares the first one."""
    return "cuda" if resources.num_gpus > 0 else "cpu"


def quiet_libraries() -> None:
    """Keep library chatter (a progress bar per model load, torchao's notes about optional GPU
    kernels, torch deprecation notes) out of the run's output, where it buries the metrics.

    Called by the CLI, and in every Ray worker through `worker_process_setup_hook`.
    """
    import logging  # noqa: PLC0415
    import warnings  # noqa: PLC0415

    for key, value in (("TRANSFORMERS_VERBOSITY", "error"), ("HF_HUB_DISABLE_PROGRESS_BARS", "1"),
                       ("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("VLLM_LOGGING_LEVEL", "ERROR")):
        os.environ.setdefault(key, value)
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def check_on_policy(model: torch.nn.Module, on_policy: str) -> None:
    """`sampling.on_policy: bitwise` needs a model the batch-invariant mode covers
    (model/batch_invariant.py); which one a path or hub name holds is known only once it is loaded."""
    if on_policy != "bitwise":
        return
    # Imported here: it pulls in transformers' attention and masking modules, ~3 s on a CPU, and this
    # module is imported by the CLI and by every Ray worker's set-up.
    from k3post.model.batch_invariant import unsupported  # noqa: PLC0415

    why = unsupported(model)
    if why is not None:
        raise UserError(f"sampling.on_policy: bitwise: the batch-invariant mode does not cover this student: {why}; "
                        f"use sampling.on_policy: off (docs/on-policy.md)")
