"""The Weights & Biases sink (`track: [{kind: wandb, ...}]`; pip install 'k3post[wandb]').

The run's id is kept in run_dir/track.json, and a resumed run is initialised with that id and
`resume="allow"`, so it continues the same W&B run. W&B refuses steps at or below the last one it
holds: steps that a crashed run logged after its last checkpoint keep their first values there
(metrics.jsonl holds the re-run's). `offline: true` writes the run under run_dir/wandb and
contacts nothing (`wandb sync runs/<run>/wandb/offline-run-*` uploads it). W&B's console capture
is off: k3post prints its own progress.
"""

from __future__ import annotations

import secrets
import string
from pathlib import Path

from k3post.config.track_schema import WandbSinkSpec
from k3post.track.run_ids import resumed_id, write_id


def new_run_id() -> str:
    """Eight random lowercase letters and digits, W&B's own id format."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbSink:
    def __init__(self, spec: WandbSinkSpec, run_dir: Path, resume_step: int | None, config: dict):
        import wandb  # noqa: PLC0415 - optional package, slow import

        run_dir = Path(run_dir).resolve()
        run_id = resumed_id(run_dir, "wandb", resume_step) or new_run_id()
        self._run = wandb.init(
            project=spec.project, entity=spec.entity, group=spec.group, name=spec.name or run_dir.name,
            tags=list(spec.tags), id=run_id, resume="allow", dir=str(run_dir),
            mode="offline" if spec.offline else "online",
            settings=wandb.Settings(console="off", silent=True))
        # The resolved recipe as the run's config; on a resume its resumable keys may have changed.
        self._run.config.update(config, allow_val_change=True)
        write_id(run_dir, "wandb", run_id)
        where = f"offline, in {run_dir / 'wandb'}" if spec.offline else getattr(self._run, "url", None) or "online"
        print(f"k3post: W&B run {run_id} ({where})")

    def log(self, step: int, record: dict) -> None:
        self._run.log({k: v for k, v in record.items() if v is not None}, step=step)

    def close(self, failed: bool = False) -> None:
        if self._run is not None:
            self._run.finish(exit_code=1 if failed else 0)
            self._run = None
