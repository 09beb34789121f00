"""Per-step metrics: run_dir/metrics.jsonl is the source of truth; TensorBoard, W&B and MLflow
are mirrors (the sinks of a recipe's `track:`, track/*_sink.py), given the same records.

One JSON object per line, `{"step": N, "<name>": value, ...}`. Non-finite values (NaN,
±inf) are written as JSON `null`, because bare `NaN` is not valid JSON and strings like
"nan" break plotting tools; read_metrics returns them as None, and the mirrors leave them out.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from k3post.track.jsonl_sink import METRICS_FILE, JsonlSink, read_metrics  # noqa: F401 - read_metrics: public here
from k3post.track.tensorboard_sink import TENSORBOARD_DIR  # noqa: F401


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


class MetricsLog:
    """Logs one record per step to every sink: run_dir/metrics.jsonl always, TensorBoard
    (tensorboard=True, the default), and any `sinks` opened from a recipe's `track:`
    (track/sinks.py: open_sinks). Every sink gets the same record for the same step.

    resume_step: step of the checkpoint being resumed (steps <= resume_step are done; the JSONL
    log is cut back to it, TensorBoard hides later events). With resume_step=None (a fresh run)
    an existing metrics.jsonl is moved aside to metrics.jsonl.prev-<unix time>, not appended to.
    """

    def __init__(self, run_dir: Path, resume_step: int | None = None, tensorboard: bool = True,
                 sinks: Sequence = ()):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / METRICS_FILE
        self.sinks: list = [JsonlSink(self.run_dir, resume_step)]
        if tensorboard:
            from k3post.track.tensorboard_sink import TensorboardSink  # noqa: PLC0415 - slow import

            self.sinks.append(TensorboardSink(self.run_dir, resume_step))
        self.sinks.extend(sinks)

    @classmethod
    def for_run(cls, run_dir: Path, resume_step: int | None = None) -> "MetricsLog":
        """The sinks of the run's recipe (`track:` in run_dir/recipe.resolved.yaml), its
        resolved recipe logged as each tracked run's config."""
        from k3post.track.sinks import open_sinks, run_track_config  # noqa: PLC0415

        specs, config = run_track_config(run_dir)
        return cls(run_dir, resume_step, tensorboard=False, sinks=open_sinks(specs, run_dir, resume_step, config))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Send {"step": step, **metrics} to every sink (metrics.jsonl first, durably)."""
        if "step" in metrics:
            raise ValueError("'step' is reserved in metrics; pass it as the step argument")
        record = {key: _to_number(key, value) for key, value in metrics.items()}
        for sink in self.sinks:
            sink.log(int(step), record)

    def close(self, failed: bool = False) -> None:
        """Close every sink (a tracked run is marked failed when `failed`); safe to call twice."""
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.close(failed=failed)

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, exc_type, *exc_info: object) -> None:
        self.close(failed=exc_type is not None)
