"""`track:` — where a training run's metrics go (k3post/track/sinks.py opens them).

A list of sinks, each `kind:` plus its own options:

    track:
      - kind: tensorboard                 # the default (run_dir/tensorboard)
      - kind: wandb                       # pip install 'k3post[wandb]'
        project: my-project
        offline: true                     # files under run_dir/wandb; `wandb sync` them later
      - kind: mlflow                      # pip install 'k3post[mlflow]'
        tracking_uri: http://mlflow:5000  # default: MLFLOW_TRACKING_URI, else run_dir/mlruns

`metrics.jsonl` is always written (it is the run's source of truth; `kind: jsonl` may be listed
and changes nothing). Every sink gets the same records with the same step numbers. A sink
whose package is not installed fails at load, with the `pip install` line, before anything starts.
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, Field, model_validator

from k3post.config.base import Strict


def installed(package: str) -> bool:
    """Whether `package` can be imported here (without importing it: both are slow to import)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _require(package: str, extra: str, kind: str) -> None:
    if not installed(package):
        raise ValueError(f"the {kind} sink needs the {package} package, which is not installed here; "
                         f"pip install 'k3post[{extra}]' (or pip install {package})")


class JsonlSinkSpec(Strict):
    """run_dir/metrics.jsonl: always written; listing it is allowed and changes nothing."""

    kind: Literal["jsonl"] = Field(description="run_dir/metrics.jsonl, always written (listing it changes nothing)")


class TensorboardSinkSpec(Strict):
    """run_dir/tensorboard (`tensorboard --logdir runs`)."""

    kind: Literal["tensorboard"] = Field(description="TensorBoard event files in run_dir/tensorboard")


class WandbSinkSpec(Strict):
    """A Weights & Biases run. Its id is kept in run_dir/track.json: a resumed run logs into the
    same W&B run. The resolved recipe is the run's config."""

    kind: Literal["wandb"] = Field(description="a Weights & Biases run (pip install 'k3post[wandb]')")
    project: str = Field("k3post", min_length=1, description="the W&B project")
    entity: str | None = Field(None, description="the W&B entity (user or team); null: your default one")
    name: str | None = Field(None, description="the run's display name; null: the run directory's name")
    group: str | None = Field(None, description="the W&B group the run belongs to")
    tags: list[str] = Field([], description="the W&B run's tags")
    offline: bool = Field(False, description=(
        "write the W&B files under run_dir/wandb and contact nothing; `wandb sync` uploads them later"))

    @model_validator(mode="after")
    def _installed(self) -> "WandbSinkSpec":
        _require("wandb", "wandb", "wandb")
        return self


class MlflowSinkSpec(Strict):
    """An MLflow run. Its id is kept in run_dir/track.json: a resumed run logs into the same
    MLflow run. The resolved recipe is logged as the run's params and as an artifact."""

    kind: Literal["mlflow"] = Field(description="an MLflow run (pip install 'k3post[mlflow]')")
    # A local file store is viewed with `mlflow ui --backend-store-uri runs/<run>/mlruns`.
    tracking_uri: str | None = Field(None, description=(
        "the MLflow tracking server or store; null: MLFLOW_TRACKING_URI if set, else a file store in run_dir/mlruns"))
    experiment: str = Field("k3post", min_length=1, description="the MLflow experiment")
    run_name: str | None = Field(None, description="the run's name; null: the run directory's name")
    tags: dict[str, str] = Field({}, description="tags of the MLflow run")

    @model_validator(mode="after")
    def _installed(self) -> "MlflowSinkSpec":
        _require("mlflow", "mlflow", "mlflow")
        return self


SinkSpec = Annotated[Union[JsonlSinkSpec, TensorboardSinkSpec, WandbSinkSpec, MlflowSinkSpec],
                     Field(discriminator="kind")]


def default_track() -> list:
    """What a recipe without `track:` gets: metrics.jsonl and TensorBoard (as in earlier versions)."""
    return [TensorboardSinkSpec(kind="tensorboard")]


def check_track(sinks: list) -> list:
    """At most one sink of each kind (two W&B runs for one training run would share one id file)."""
    kinds = [s.kind for s in sinks]
    repeated = sorted({k for k in kinds if kinds.count(k) > 1})
    if repeated:
        raise ValueError(f"track: one sink of each kind (got {', '.join(repeated)} more than once)")
    return sinks


TrackSpec = Annotated[list[SinkSpec], AfterValidator(check_track), Field(default_factory=default_track)]
