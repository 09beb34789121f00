"""Opening the sinks a recipe's `track:` names (config/track_schema.py), for MetricsLog.

A sink is any object with `log(step, record)` and `close(failed=False)`; `record` maps metric
names to plain numbers, None for a non-finite value. metrics.jsonl (JsonlSink) is always
first and is not opened here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import yaml

from k3post.config.track_schema import default_track


class Sink(Protocol):
    def log(self, step: int, record: dict) -> None: ...

    def close(self, failed: bool = False) -> None: ...


def open_sinks(specs: list, run_dir: Path, resume_step: int | None, config: dict) -> list[Sink]:
    """One sink per spec (jsonl skipped: always on). `config` is the resolved recipe, logged as
    each tracked run's config. A sink that fails to open closes those opened before it."""
    opened: list[Sink] = []
    try:
        for spec in specs:
            if spec.kind == "tensorboard":
                from k3post.track.tensorboard_sink import TensorboardSink  # noqa: PLC0415

                opened.append(TensorboardSink(run_dir, resume_step))
            elif spec.kind == "wandb":
                from k3post.track.wandb_sink import WandbSink  # noqa: PLC0415

                opened.append(WandbSink(spec, run_dir, resume_step, config))
            elif spec.kind == "mlflow":
                from k3post.track.mlflow_sink import MlflowSink  # noqa: PLC0415

                opened.append(MlflowSink(spec, run_dir, resume_step, config))
    except BaseException:
        for sink in opened:
            sink.close(failed=True)
        raise
    return opened


def run_track_config(run_dir: Path) -> tuple[list, dict]:
    """(the sink specs, the resolved recipe) of the run in `run_dir`, from its recipe.resolved.yaml
    (written by `k3post run` before the loop starts). Without one (a loop driven directly, as the
    tests do) the default sinks and an empty config."""
    from pydantic import TypeAdapter  # noqa: PLC0415

    from k3post.config.track_schema import TrackSpec  # noqa: PLC0415
    from k3post.track.run_dir import RESOLVED  # noqa: PLC0415

    path = Path(run_dir) / RESOLVED
    if not path.is_file():
        return default_track(), {}
    config = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    specs = TypeAdapter(TrackSpec).validate_python(config["track"]) if "track" in config else default_track()
    return specs, config
