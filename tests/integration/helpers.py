"""Helpers of the integration tests: paths, environments, and finding and killing the processes of
a run (only ever our own: by pid, from the process tree of a process the test started)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from k3post.track.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SMOKE = "recipes/smoke/tiny.yaml"
TOKEN = "k3post-test-token-0123456789abcdef"
# The fault-injection runs: long enough to be killed in the middle, every step checkpointed.
STEPS = 5
ARGS = [f"train.steps={STEPS}", "train.eval_every=0", "train.checkpoint_every=1", "train.keep_checkpoints=3"]
COMPARED = ("distill/kl/alpha", "distill/kl/beta", "train/loss", "train/grad_norm", "train/lr", "eval/kl/alpha",
            "eval/fkl/beta")


def assert_same_run(metrics: list[dict], reference: list[dict], steps: int = STEPS + 1) -> None:
    """Every step of the first `steps` (all, by default) logged exactly once, with the uninterrupted run's values."""
    assert [m["step"] for m in metrics] == list(range(steps))
    for got, want in zip(metrics, reference):
        for key in COMPARED:
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-6), (want["step"], key)


def upload_excludes() -> list[str]:
    """What a job submitted with `--working-dir .` leaves out of its upload of this checkout:
    .venv, runs and .git, and every top-level path git ignores (.gitignore or .git/info/exclude:
    local caches, build outputs, bundles), which Ray's packaging would otherwise zip and send (it
    reads .gitignore files only): a checkout holding a large one fails to submit (the head takes
    100 MiB at most) or spends its time zipping."""
    listed = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--directory"],
                            cwd=REPO, capture_output=True, text=True)
    ignored = [path for path in listed.stdout.splitlines() if "/" not in path.rstrip("/")]
    return ["runs", ".venv", ".git", *(f"/{path}" for path in ignored if listed.returncode == 0)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_without_ray_address(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    env.update(extra)
    return env


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def actor_pids(root_pid: int, actor_class: str) -> list[int]:
    """Pids of the Ray actors of one class under a process tree: Ray titles an actor's process
    `ray::<Class>` (`ray::<Class>.<method>` while it runs one)."""
    pids = []
    for proc in descendants(root_pid):
        try:
            title = " ".join(proc.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title.startswith(f"ray::{actor_class}"):
            pids.append(proc.pid)
    return pids


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_tree(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGKILL what is left of these processes after a grace period (a killed driver's cluster,
    a stopped head)."""
    deadline = time.time() + grace_s
    alive = [p for p in processes if _alive(p)]
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _alive(p)]
    for proc in alive:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


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
