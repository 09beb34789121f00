"""The MLflow sink (`track: [{kind: mlflow, ...}]`; pip install 'k3post[mlflow]').

The tracking URI is the sink's `tracking_uri`, else MLFLOW_TRACKING_URI, else a local file
store in run_dir/mlruns (`mlflow ui --backend-store-uri runs/<run>/mlruns`; MLflow 3 keeps file
stores behind MLFLOW_ALLOW_FILE_STORE, which this sink sets for the local store). The run's id is
kept in run_dir/track.json: a resumed run logs into the same MLflow run. The resolved recipe is
the run's params (flattened, `optim.lr`; logged when the run is created: MLflow params cannot
change) and the artifact recipe.resolved.yaml (rewritten on each start).

A file store keeps each metric in a file whose path is its name, so `train/loss` (a file) and
`train/loss/alpha` (a file under a directory of that name) cannot both exist: in a file store
metric names are written with `.` for `/` (`train.loss.alpha`); other stores get them as they are.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml

from k3post.config.track_schema import MlflowSinkSpec
from k3post.track.run_ids import resumed_id, write_id

_BATCH = 100  # MLflow's limit of params per log_batch (metrics: 1000)


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """{"optim": {"lr": 2e-4}} -> {"optim.lr": "0.0002"}; lists as JSON."""
    out: dict[str, str] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = (json.dumps(value) if isinstance(value, (list, dict)) else str(value))[:6000]
    return out


def metric_key(name: str, file_store: bool) -> str:
    return name.replace("/", ".") if file_store else name


def tracking_uri(spec: MlflowSinkSpec, run_dir: Path) -> str:
    uri = spec.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return (Path(run_dir).resolve() / "mlruns").as_uri()


class MlflowSink:
    def __init__(self, spec: MlflowSinkSpec, run_dir: Path, resume_step: int | None, config: dict):
        from mlflow.entities import Param  # noqa: PLC0415 - optional package, slow import
        from mlflow.tracking import MlflowClient  # noqa: PLC0415

        run_dir = Path(run_dir).resolve()
        self.uri = tracking_uri(spec, run_dir)
        self.file_store = self.uri.startswith("file:") or "://" not in self.uri
        if self.file_store:  # a local file store, chosen knowingly
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=self.uri)
        self.run_id = resumed_id(run_dir, "mlflow", resume_step)
        if self.run_id is None:
            found = self._client.get_experiment_by_name(spec.experiment)
            experiment = found.experiment_id if found else self._client.create_experiment(spec.experiment)
            run = self._client.create_run(experiment, run_name=spec.run_name or run_dir.name, tags=dict(spec.tags))
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in flatten(config).items()]
            for i in range(0, len(params), _BATCH):
                self._client.log_batch(self.run_id, params=params[i:i + _BATCH])
        else:
            self._client.update_run(self.run_id, status="RUNNING")
        self._client.log_text(self.run_id, yaml.safe_dump(config, sort_keys=False), "recipe.resolved.yaml")
        write_id(run_dir, "mlflow", self.run_id)
        print(f"k3post: MLflow run {self.run_id} ({self.uri})")

    def log(self, step: int, record: dict) -> None:
        from mlflow.entities import Metric  # noqa: PLC0415

        now = int(time.time() * 1000)
        metrics = [Metric(metric_key(k, self.file_store), float(v), now, step)
                   for k, v in record.items() if v is not None]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def close(self, failed: bool = False) -> None:
        if self._client is not None:
            self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
            self._client = None
