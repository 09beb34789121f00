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

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
SMOKE = "recipes/smoke/tiny.yaml"
TOKEN = "k3post-test-token-0123456789abcdef"


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


def kill_tree(processes: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGKILL what is left of these processes (a killed driver's cluster, a stopped head)."""
    deadline = time.time() + grace_s
    alive = [p for p in processes if p.is_running()]
    while alive and time.time() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    for proc in alive:
        try:
            proc.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
