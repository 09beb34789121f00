"""Rank 0 publishes a sharded checkpoint only if every shard file DCP's metadata lists is in its own
view of the run directory (engine/learner/sharded_checkpoint.py: check_shards_here): ranks on other nodes
write where *they* see the path, so a run directory local to each node would otherwise publish a
checkpoint whose other shards are on other machines."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from k3post.config.errors import UserError
from k3post.engine.learner.sharded_checkpoint import DCP_DIR, check_shards_here


def test_a_shard_rank_0_does_not_see_stops_the_publish_naming_it(tmp_path):
    step = tmp_path / "run" / "checkpoints" / ".step-3.tmp-1"
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(step / DCP_DIR), no_dist=True)
    check_shards_here(step)  # every listed shard here: silent
    shard = next((step / DCP_DIR).glob("*.distcp"))
    shard.unlink()  # what rank 0 sees when another node wrote it to its own disk
    with pytest.raises(UserError) as err:
        check_shards_here(step)
    message = str(err.value)
    assert message.startswith(f"{tmp_path / 'run'}: ") and shard.name in message and "shared" in message
