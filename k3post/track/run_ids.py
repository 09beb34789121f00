"""run_dir/track.json: the ids of the tracked runs (W&B, MLflow) this run directory logs to.

A fresh run gets new ids; a resumed run (a checkpoint is resumed) reads them back, so W&B and
MLflow show one run that went on, not one run per restart.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3post.track.atomic import write_text_atomic

IDS_FILE = "track.json"


def read_ids(run_dir: Path) -> dict[str, str]:
    path = Path(run_dir) / IDS_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # none yet, or damaged: the run starts a new tracked run
        return {}
    return {k: v for k, v in data.items() if isinstance(v, str)} if isinstance(data, dict) else {}


def write_id(run_dir: Path, kind: str, run_id: str) -> None:
    ids = read_ids(run_dir)
    ids[kind] = run_id
    write_text_atomic(Path(run_dir) / IDS_FILE, json.dumps(ids, indent=1) + "\n")


def resumed_id(run_dir: Path, kind: str, resume_step: int | None) -> str | None:
    """The id to go on logging to: the saved one when the run resumes a checkpoint, else None."""
    return read_ids(run_dir).get(kind) if resume_step is not None else None
