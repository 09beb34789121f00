"""The JSONL sink: run_dir/metrics.jsonl, the run's source of truth (every other sink mirrors it).

One JSON object per line, `{"step": N, "<name>": value, ...}`, appended and fsynced, so a crash
tears at most the line being written. Non-finite values are already `None` here (JSON `null`:
bare `NaN` is not valid JSON).
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

from k3post.track.atomic import write_text_atomic

METRICS_FILE = "metrics.jsonl"


def parse_lines(text: str, source: Path) -> list[dict]:
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
    return parse_lines(path.read_text(encoding="utf-8"), path)


class JsonlSink:
    """resume_step: step of the checkpoint being resumed (steps <= resume_step are done). Lines
    for later steps, logged after that checkpoint by the crashed run, are dropped so that every
    step appears exactly once. With resume_step=None (a fresh run) an existing metrics.jsonl is
    moved aside to metrics.jsonl.prev-<unix time>, not appended to."""

    def __init__(self, run_dir: Path, resume_step: int | None):
        self.path = Path(run_dir) / METRICS_FILE
        self._prepare_file(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

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
        # No allow_nan=False here: a resume must never fail on what was already logged.
        write_text_atomic(self.path, "".join(json.dumps(by_step[s]) + "\n" for s in sorted(by_step)))

    def log(self, step: int, record: dict) -> None:
        self._file.write(json.dumps({"step": step, **record}, allow_nan=False) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self, failed: bool = False) -> None:
        if not self._file.closed:
            self._file.close()
