"""The TensorBoard sink: run_dir/tensorboard (`tensorboard --logdir runs`)."""

from __future__ import annotations

from pathlib import Path

TENSORBOARD_DIR = "tensorboard"


class TensorboardSink:
    def __init__(self, run_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415 - slow import, optional sink

        # purge_step tells TensorBoard to hide events the crashed run wrote after the checkpoint.
        purge = None if resume_step is None else resume_step + 1
        self._writer = SummaryWriter(log_dir=str(Path(run_dir) / TENSORBOARD_DIR), purge_step=purge)

    def log(self, step: int, record: dict) -> None:
        for key, value in record.items():
            if value is not None:  # None = non-finite: TensorBoard would plot garbage
                self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
