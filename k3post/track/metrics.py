"""Per-step metrics: run_dir/metrics.jsonl is the source of truth, TensorBoard a mirror.

One JSON object per line, `{"step": N, "<name>": value, ...}`. Non-finite values (NaN,
±inf) are written as JSON `null`, because bare `NaN` is not valid JSON and strings like
"nan" break plotting tools; read_metrics returns them as None.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any

from k3post.track.atomic import write_text_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def _to_number(key: str, value: Any) -> int | float | None:
    """Plain int/float for JSON; 0-d tensors and numpy scalars via .item(); non-finite -> None."""
    if hasattr(value, "item"):  # torch tensors and numpy scalars; keeps ints as ints
        try:
            value = value.item()
        except (RuntimeError, ValueError) as exc:  # more than one element
            raise TypeError(f"metric {key!r} must be a scalar, got {value!r}") from exc
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}") from exc
    return number if math.isfinite(number) else None


def _parse_lines(text: str, source: Path) -> list[dict]:
    """Parse JSONL text; a torn last line (crash mid-write) is dropped silently, other bad lines
    with a warning, so a resume never fails on a damaged log."""
    lines = text.splitlines()
    records = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index != len(lines) - 1:
                warnings.warn(f"{source}:{index + 1}: dropping unparsable metrics line")
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
    return records


def read_metrics(path: Path) -> list[dict]:
    """All records of a metrics.jsonl file in file order ([] if it does not exist)."""
    path = Path(path)
    if not path.exists():
        return []
    return _parse_lines(path.read_text(encoding="utf-8"), path)


def _records_to_text(records: list[dict]) -> str:
    """JSONL text of already-logged records (no allow_nan=False: a resume must never fail here)."""
    return "".join(json.dumps(r) + "\n" for r in records)


class MetricsLog:
    """Appends one JSON object per step to run_dir/metrics.jsonl and mirrors scalars to TensorBoard
    (run_dir/tensorboard).

    resume_step: step of the checkpoint being resumed (steps <= resume_step are done). Lines
    for later steps, logged after that checkpoint by the crashed run, are dropped so that
    every step appears exactly once. With resume_step=None (a fresh run) an existing
    metrics.jsonl is moved aside to metrics.jsonl.prev-<unix time>, not appended to.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None, tensorboard: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self._prepare_file(resume_step)
        # Append mode + fsync per line: after a crash at most the line being written is torn.
        self._file = open(self.path, "a", encoding="utf-8")
        self._writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # lazy: slow import, optional

            # purge_step tells TensorBoard to hide events the crashed run wrote after the checkpoint.
            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR), purge_step=purge)

    def _prepare_file(self, resume_step: int | None) -> None:
        """Truncate the log to the resumed checkpoint (atomically), or set aside a stale one."""
        if not self.path.exists():
            return
        if resume_step is None:
            if self.path.stat().st_size > 0:
                os.replace(self.path, self.path.with_name(f"{METRICS_FILE}.prev-{int(time.time())}"))
            return
        # Last record per step wins, in step order: exactly one line per finished step.
        by_step = {r["step"]: r for r in read_metrics(self.path) if r["step"] <= resume_step}
        write_text_atomic(self.path, _records_to_text([by_step[s] for s in sorted(by_step)]))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Write {"step": step, **metrics} durably and mirror the finite values to TensorBoard."""
        if "step" in metrics:
            raise ValueError("'step' is reserved in metrics; pass it as the step argument")
        record: dict[str, Any] = {"step": int(step)}
        for key, value in metrics.items():
            record[key] = _to_number(key, value)
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and value is not None:  # None = non-finite, TB would plot garbage
                    self._writer.add_scalar(key, value, global_step=int(step))
            self._writer.flush()

    def close(self) -> None:
        """Close the file and the TensorBoard writer; safe to call twice."""
        if not self._file.closed:
            self._file.close()
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
