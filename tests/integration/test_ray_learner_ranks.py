"""The learner as a group of ranks on a real local Ray cluster (2 gloo ranks, FSDP2), against the
one-process run of the same recipe (the `tiny_reference` fixture, in process):

- a rank SIGKILLed mid-run ends the run with one line naming the rank, and the 2-rank steps
  before the kill equal the one-process ones;
- (opt-in, K3POST_SLOW=1) re-running the same command then resumes and ends with the one-process
  run's metrics at every step; and a run started on one unsharded learner process and killed
  mid-run resumes on 2 ranks (its checkpoint reshards) and ends with the same metrics.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from k3post.track.atomic import HOLD_ENV
from k3post.track.metrics import read_metrics
from tests.integration.helpers import (ARGS, BIN, REPO, SMOKE, actor_pids, assert_same_run, env_without_ray_address,
                                      logged_steps, wait_for)

pytestmark = pytest.mark.integration
TWO_RANKS = ["resources.learner.replicas=2"]


def start(run_dir: Path, log: Path, *extra: str, hold: str | None = None) -> subprocess.Popen:
    env = env_without_ray_address(**({HOLD_ENV: hold} if hold else {}))
    with open(log, "a") as out:
        return subprocess.Popen([str(BIN / "k3post"), "run", SMOKE, *ARGS, *extra, "--run-dir", str(run_dir)],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)


def kill_a_rank_after_step_2(tmp_path: Path) -> tuple[Path, str]:
    """A 2-rank run whose rank 1 is SIGKILLed once step 2 is logged; (its run dir, its output)."""
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start(run_dir, log, *TWO_RANKS)
    try:
        wait_for(lambda: 2 in logged_steps(run_dir), proc, log)
        ranks = actor_pids(proc.pid, "ShardedLearner")
        assert len(ranks) == 2, log.read_text()[-3000:]
        os.kill(ranks[1], signal.SIGKILL)
        assert proc.wait(timeout=300) == 1
    finally:
        proc.kill()
    return run_dir, log.read_text()


def test_a_killed_rank_ends_the_run_in_one_line(tmp_path, tiny_reference):
    run_dir, output = kill_a_rank_after_step_2(tmp_path)
    error = [line for line in output.splitlines() if line.startswith("k3post: error:")]
    assert len(error) == 1 and "learner rank" in error[0] and "of 2 died" in error[0], output[-3000:]
    assert "Traceback" not in output
    logged = read_metrics(run_dir / "metrics.jsonl")
    assert_same_run(logged[:3], tiny_reference[:3], steps=3)  # 2 ranks on Ray = one process, step by step


@pytest.mark.slow  # opt-in (K3POST_SLOW=1, ~35 s more): the resume repeats what make test proves apart. A run
# killed on Ray resumes by the same command: tests/integration/test_faults.py; 2 ranks' checkpoints resume
# the uninterrupted run: tests/unit/test_sharded_learner.py (test_checkpoints_reshard_and_resume_the_uninterrupted_run).
def test_after_a_killed_rank_the_same_command_resumes(tmp_path, tiny_reference):
    run_dir, _ = kill_a_rank_after_step_2(tmp_path)
    rerun_log = tmp_path / "rerun.log"
    rerun = start(run_dir, rerun_log, *TWO_RANKS)
    assert rerun.wait(timeout=400) == 0, rerun_log.read_text()[-4000:]
    assert "resumed from" in rerun_log.read_text()
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), tiny_reference)


@pytest.mark.slow  # opt-in (K3POST_SLOW=1, 78 s): resharding 1 -> 2 ranks on resume runs in make test in
# tests/unit/test_sharded_learner.py (test_checkpoints_reshard_and_resume_the_uninterrupted_run)
def test_a_one_process_run_resumes_on_two_ranks(tmp_path, tiny_reference):
    """The first leg runs the full recipe (its schedule is the 5-step one) on one unsharded
    learner process and is killed while it writes step-4 (held there: track/atomic.py's
    fault-injection point), so the second leg resumes on 2 ranks from step-3."""
    run_dir, first_log = tmp_path / "run", tmp_path / "first.log"
    first = start(run_dir, first_log, hold="step-4")
    try:
        wait_for(lambda: any(p.name.startswith(".step-4.tmp-") for p in (run_dir / "checkpoints").glob(".step-*")),
                 first, first_log)
        learners = actor_pids(first.pid, "Learner")
        assert len(learners) == 1 and not actor_pids(first.pid, "ShardedLearner")
        for pid in [*learners, first.pid]:
            os.kill(pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
    second_log = tmp_path / "second.log"
    second = start(run_dir, second_log, *TWO_RANKS)
    assert second.wait(timeout=400) == 0, second_log.read_text()[-4000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step-3'}" in second_log.read_text()
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), tiny_reference)
