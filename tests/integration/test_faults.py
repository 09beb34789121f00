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

from k3post.cli.run import run_recipe
from k3post.track.metrics import read_metrics
from tests.integration.helpers import BIN, REPO, SMOKE, actor_pids, descendants, env_without_ray_address, kill_tree

pytestmark = pytest.mark.integration

STEPS = 5
ARGS = [f"train.steps={STEPS}", "train.eval_every=0", "train.checkpoint_every=1", "train.keep_checkpoints=3"]
COMPARED = ("distill/kl/alpha", "distill/kl/beta", "train/loss", "train/grad_norm", "train/lr", "eval/kl/alpha",
            "eval/fkl/beta")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_recipe(REPO / SMOKE, ARGS, run_dir, in_process=True, restart=False) == 0
    return read_metrics(run_dir / "metrics.jsonl")


def assert_same_run(metrics: list[dict], reference: list[dict]) -> None:
    assert [m["step"] for m in metrics] == list(range(STEPS + 1))  # every step exactly once
    for got, want in zip(metrics, reference):
        for key in COMPARED:
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["step"], key)


def start_run(run_dir: Path, log: Path) -> subprocess.Popen:
    with open(log, "a") as out:
        return subprocess.Popen([str(BIN / "k3post"), "run", SMOKE, *ARGS, "--run-dir", str(run_dir)], cwd=REPO,
                                env=env_without_ray_address(), stdout=out, stderr=subprocess.STDOUT)


def logged_steps(run_dir: Path) -> list[int]:
    return [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")]


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout_s: float = 300, poll_s: float = 0.005):
    """Poll `condition` until it returns something truthy (returned); fail if the run ends first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        found = condition()
        if found:
            return found
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) first:\n{log.read_text()[-3000:]}"
        time.sleep(poll_s)
    raise TimeoutError(f"gave up waiting:\n{log.read_text()[-3000:]}")


def busy_actor(root_pid: int, actor_class: str) -> int | None:
    """The pid of an actor of this class while it is running a call (title `ray::Class.method`)."""
    for proc in descendants(root_pid):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title.startswith(f"ray::{actor_class}."):
            return proc.pid
    return None


def test_killed_sampler_and_teacher_are_restarted_and_the_run_is_unchanged(tmp_path, reference):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_run(run_dir, log)
    try:
        wait_for(lambda: 1 in logged_steps(run_dir), proc, log)  # the sampler now holds weights v1
        sampler = wait_for(lambda: busy_actor(proc.pid, "HFSampler"), proc, log)
        os.kill(sampler, signal.SIGKILL)  # mid-call: Ray restarts the actor and retries the call
        wait_for(lambda: 3 in logged_steps(run_dir), proc, log)
        teacher = wait_for(lambda: busy_actor(proc.pid, "TeacherScorer"), proc, log)
        os.kill(teacher, signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, log.read_text()[-4000:]
    finally:
        proc.kill()
    output = log.read_text()
    # The restarted sampler came back with the constructor's weights and reloaded the run's.
    assert "(restarted?): reloading them" in output, output[-4000:]
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), reference)


def writing_checkpoint(run_dir: Path) -> Path | None:
    """A checkpoint being written: the learner fills `.step-N.tmp-<pid>` and renames it at the end."""
    root = run_dir / "checkpoints"
    try:
        temps = [e for e in os.scandir(root) if e.name.startswith(".step-") and ".tmp-" in e.name]
    except FileNotFoundError:
        return None
    return Path(temps[0].path) if temps and not temps[0].name.startswith(".step-1.") else None


def test_killed_mid_checkpoint_the_rerun_resumes_from_the_last_complete_one(tmp_path, reference):
    run_dir, log = tmp_path / "run", tmp_path / "run.log"
    proc = start_run(run_dir, log)
    cluster: list[psutil.Process] = []
    rerun = None
    try:
        partial = wait_for(lambda: writing_checkpoint(run_dir), proc, log)
        cluster = descendants(proc.pid)
        # A node lost mid-save: the learner (the writer) and the driver die at once.
        for pid in actor_pids(proc.pid, "Learner") + [proc.pid]:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
        assert partial.exists(), "the checkpoint finished before the kill; the test did not hit a write"
        killed_at = int(partial.name.split(".")[1].removeprefix("step-"))
        assert STEPS not in logged_steps(run_dir)
        # Re-run the same command at once, beside whatever is left of the killed run's cluster.
        rerun_log = tmp_path / "rerun.log"
        rerun = start_run(run_dir, rerun_log)
        assert rerun.wait(timeout=300) == 0, rerun_log.read_text()[-4000:]
    finally:
        for p in (proc, rerun):
            if p is not None:
                p.kill()
        kill_tree(cluster)  # Ray's dashboard and runtime-env agents outlive a SIGKILLed driver
    output = rerun_log.read_text()
    assert f"resumed from {run_dir / 'checkpoints' / f'step-{killed_at - 1}'}" in output, output[-3000:]
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")]  # stale temp cleaned
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), reference)
