"""Fault injection on real local Ray clusters with tiny models: real processes killed with SIGKILL.

- a sampler and a teacher actor killed while they run a call: Ray restarts them, the call is
  retried, the restarted sampler reloads the run's weights, and the run's metrics are those of
  an uninterrupted run;
- the learner and the driver killed while a checkpoint is being written (a node lost mid-save):
  the half-written checkpoint is never used, re-running the same command resumes from the last
  complete one, with a fresh Ray cluster beside what is left of the old one, and ends with the
  uninterrupted run's metrics, each step logged once.

The reference is the same recipe run in-process (no Ray): the engines are deterministic, so a
run on Ray, interrupted or not, must reproduce it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from k3post.track.atomic import HOLD_ENV
from k3post.track.metrics import read_metrics
from tests.integration.helpers import (ARGS, BIN, REPO, SMOKE, STEPS, actor_pids, assert_same_run, descendants,
                                      env_without_ray_address, kill_tree, logged_steps, wait_for)

pytestmark = pytest.mark.integration


def start_run(run_dir: Path, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([str(BIN / "k3post"), "run", SMOKE, *ARGS, "--run-dir", str(run_dir)], cwd=REPO,
                                env=env_without_ray_address(**env), stdout=out, stderr=subprocess.STDOUT)


def title(pid: int) -> str:
    """A process's title, read straight from /proc (fast enough to poll every millisecond)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def busy(pids: list[int], call: str) -> int | None:
    """Which of these actors is running `call` now: Ray titles it `ray::<Class>.<method>`."""
    return next((pid for pid in pids if title(pid).startswith(call)), None)


def test_killed_sampler_and_teacher_are_restarted_and_the_run_is_unchanged(tmp_path, tiny_reference):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_run(run_dir, log)
    try:
        wait_for(lambda: 1 in logged_steps(run_dir), proc, log)  # the sampler now holds weights v1
        samplers = actor_pids(proc.pid, "HFSampler")
        # Mid-call (a sample, through __ray_call__): Ray restarts the actor and retries the call,
        # which must first reload the run's weights into the fresh replica.
        sampler = wait_for(lambda: busy(samplers, "ray::HFSampler.__ray_call__"), proc, log, poll_s=0.001)
        os.kill(sampler, signal.SIGKILL)
        wait_for(lambda: 3 in logged_steps(run_dir), proc, log)
        teachers = actor_pids(proc.pid, "TeacherScorer")
        teacher = wait_for(lambda: busy(teachers, "ray::TeacherScorer."), proc, log, poll_s=0.001)
        os.kill(teacher, signal.SIGKILL)  # mid-score: without a retry the run would fail here
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        proc.kill()
    output = log.read_text()
    # No RAY_ADDRESS: the run starts a cluster of its own (the shared head's runs join one instead).
    assert "started a local Ray cluster" in output, output[-4000:]
    assert "(restarted?): reloading them" in output, output[-4000:]
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), tiny_reference)


def is_agent(proc: psutil.Process) -> bool:
    try:
        return "Agent" in " ".join(proc.cmdline()) or "agent" in " ".join(proc.cmdline()[1:3])
    except psutil.NoSuchProcess:
        return False


def wait_for_exit(processes: list[psutil.Process], timeout_s: float) -> list[str]:
    """The command lines of those still running after `timeout_s`."""
    deadline = time.time() + timeout_s
    while True:
        alive = []
        for proc in processes:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(proc.cmdline())[:120])
            except psutil.NoSuchProcess:
                pass
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.5)


def writing_checkpoint(run_dir: Path, step: int) -> Path | None:
    """Checkpoint `step` being written: the learner fills `.step-N.tmp-<pid>` and renames it at the end."""
    root = run_dir / "checkpoints"
    try:
        temps = [e for e in os.scandir(root) if e.name.startswith(f".step-{step}.tmp-")]
    except FileNotFoundError:
        return None
    return Path(temps[0].path) if temps else None


def test_killed_mid_checkpoint_the_rerun_resumes_from_the_last_complete_one(tmp_path, tiny_reference):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    # The learner stops right before publishing step-3 (track/atomic.py's fault-injection point),
    # so the kill below always meets a half-written checkpoint, however fast the machine writes.
    proc = start_run(run_dir, log, **{HOLD_ENV: "step-3"})
    cluster: list[psutil.Process] = []
    rerun = None
    try:
        wait_for(lambda: 1 in logged_steps(run_dir), proc, log)
        # Look the processes up now: when the write is seen, the kill must follow at once.
        cluster, victims = descendants(proc.pid), actor_pids(proc.pid, "Learner") + [proc.pid]
        assert len(victims) == 2, [p.cmdline() for p in cluster]
        partial = wait_for(lambda: writing_checkpoint(run_dir, 3), proc, log)
        # A node lost mid-save: the learner (the writer) and the driver die at once.
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert partial.exists(), "the checkpoint finished before the kill; the test did not hit a write"
        killed_at = int(partial.name.split(".")[1].removeprefix("step-"))
        assert STEPS not in logged_steps(run_dir)
        # The killed driver's Ray core (GCS, raylet, actors) shares its fate; only Ray's agents linger.
        assert not wait_for_exit([p for p in cluster if not is_agent(p)], timeout_s=30)
        # Re-run the same command at once, beside whatever is left of the killed run's cluster.
        rerun_log = tmp_path / "rerun.log"
        rerun = start_run(run_dir, rerun_log)
        assert rerun.wait(timeout=300) == 0, rerun_log.read_text()[-4000:]
    finally:
        for p in (proc, rerun):
            if p is not None:
                p.kill()
        # Ray's dashboard and runtime-env agents outlive a SIGKILLed driver: nothing of the killed run
        # ends by itself any more (wait_for_exit saw the rest go), so no grace period, only SIGKILL.
        kill_tree(cluster, grace_s=0)
    output = rerun_log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{killed_at - 1}'}" in output, output[-3000:]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]  # stale temp cleaned
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), tiny_reference)
