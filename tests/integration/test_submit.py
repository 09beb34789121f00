"""`k3post submit` against a real Ray head started here with token authentication on: a recipe
checked before anything is sent, a failing job reported as a failure, and preemption: a job whose
driver is stopped mid-run, resubmitted with the same run directory, resumes and finishes."""

from __future__ import annotations

import re
import subprocess
import time

import psutil
import pytest

from k3post.track.metrics import read_metrics
from tests.integration.helpers import (ARGS, BIN, REPO, SMOKE, STEPS, assert_same_run, env_without_ray_address,
                                      free_port, logged_steps)

pytestmark = pytest.mark.integration


def k3post_submit(env: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "k3post"), "submit", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_submit_checks_the_recipe_before_contacting_any_cluster():
    # Nothing listens on this port: the recipe error must come first, and alone.
    result = k3post_submit(env_without_ray_address(), SMOKE, "optim.lrr=1", "--address", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 2
    assert "optim.lrr: unknown key" in result.stderr and "Traceback" not in result.stderr
    assert "reach" not in result.stderr


def test_submit_reports_a_failing_job_as_a_failure(ray_head, tmp_path):
    env, address = ray_head
    # The loss overflows to inf/NaN at every step; train.max_skipped_steps=1 stops the run at step 1.
    result = k3post_submit(env, SMOKE, "loss.kl_coef=1e39", "train.max_skipped_steps=1", "--address", address,
                           "--run-dir", str(tmp_path / "nan"))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert re.search(r"submitted raysubmit_\w+", result.stdout)
    assert "stopped at step 1" in result.stderr and "train/skipped" in result.stderr  # the job's last log lines
    assert "FAILED" in result.stderr
    assert not (tmp_path / "nan" / "checkpoints" / "step-1").exists()


def driver_processes(run_dir) -> list[psutil.Process]:
    """The job's driver (`k3post run ... --run-dir RUN_DIR`): the run dir is unique to this test."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if str(run_dir) in cmdline and "run" in cmdline:
            found.append(proc)
    return found


def hold_at_checkpoint(run_dir, step: int, timeout_s: float) -> psutil.Process:
    """Freeze the job's driver (SIGSTOP) the moment checkpoint `step` is complete, and return it.

    A preemption test must not depend on the machine's speed: `ray job stop` takes seconds to
    start and reach the job, and a tiny job on a fast (or a loaded test) machine used to finish all
    its steps in that time. A frozen driver runs no further step; Ray's stop still kills it (the
    SIGKILL that follows SIGTERM ends a stopped process), which is the preemption under test. The
    driver is found first, while the job starts, so the freeze follows the checkpoint at once; the
    driver would need several more whole steps to finish in that gap of a few milliseconds."""
    deadline = time.time() + timeout_s
    done = run_dir / "checkpoints" / f"step-{step}" / "COMPLETE"
    drivers: list[psutil.Process] = []
    while not drivers:
        assert time.time() < deadline, "the job's driver never started"
        drivers = driver_processes(run_dir)
        time.sleep(0.2)
    assert len(drivers) == 1, [p.cmdline() for p in drivers]
    while not done.is_file():
        assert time.time() < deadline, f"the job never reached its step-{step} checkpoint"
        assert drivers[0].is_running(), "the job's driver ended before its checkpoint"
        time.sleep(0.005)
    drivers[0].suspend()
    return drivers[0]


@pytest.mark.slow  # opt-in (K3POST_SLOW=1, 77 s): resume itself runs in make test (test_faults.py, test_ray_learner_ranks.py)
def test_a_stopped_job_resubmitted_with_the_same_run_dir_resumes(ray_head, tmp_path, tiny_reference):
    env, address = ray_head
    run_dir = tmp_path / "shared-storage" / "run"
    common = [SMOKE, *ARGS, "--address", address, "--run-dir", str(run_dir)]
    first = k3post_submit(env, *common, "--no-wait")
    assert first.returncode == 0, first.stdout + first.stderr
    job = re.search(r"submitted (raysubmit_\w+)", first.stdout).group(1)
    driver = hold_at_checkpoint(run_dir, step=2, timeout_s=300)
    # Preemption: the job's driver is stopped mid-run (Ray sends SIGTERM, then SIGKILL).
    stop = subprocess.run([str(BIN / "ray"), "job", "stop", job, "--address", address], env=env,
                          capture_output=True, text=True, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    driver.resume()  # a no-op on a killed process; a driver that survived the stop would run on and be caught below
    time.sleep(2)
    assert not [p for p in driver_processes(run_dir) if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    stopped_at = max(logged_steps(run_dir))
    assert stopped_at == 2, "the job was not held at its step-2 checkpoint until it was stopped"

    again = k3post_submit(env, *common, "--follow")
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-3000:]
    assert "resumed from" in again.stdout and "succeeded" in again.stdout  # the job's log, streamed
    assert_same_run(read_metrics(run_dir / "metrics.jsonl"), tiny_reference)

