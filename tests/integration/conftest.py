"""Fixtures of the integration tests: a real Ray head on loopback with token auth, and the
reference metrics that interrupted runs must reproduce."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from k3post.cli.run import run_recipe
from k3post.track.metrics import read_metrics
from tests.integration.helpers import (ARGS, BIN, REPO, SMOKE, TOKEN, descendants, env_without_ray_address, free_port,
                                       kill_tree)


def _request(url: str, data: dict | None = None) -> dict:
    body = None if data is None else json.dumps(data).encode()
    request = urllib.request.Request(url, data=body, headers={"Authorization": f"Bearer {TOKEN}",
                                                              "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read() or b"{}")


def _wait_until_jobs_are_accepted(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 120) -> None:
    """The dashboard answers before the head's job agent is registered, and a job submitted in
    between is refused ("No available agent"); a trivial job that gets accepted proves both up."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            job = _request(f"{url}/api/jobs/", {"entrypoint": "true"})["submission_id"]
            while _request(f"{url}/api/jobs/{job}")["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
                time.sleep(0.5)
            return
        except OSError:  # not listening yet (connection refused) or refusing jobs yet (HTTP 500)
            time.sleep(1)
    raise TimeoutError(f"the Ray head at {url} did not accept jobs in {timeout_s}s: {log.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A real head node on loopback, token auth on, shared by the tests of a session.

    Started with `ray start --block` so that teardown can stop exactly this head (and whatever
    its jobs started) by pid: `ray stop` would stop every Ray cluster of the user on the machine.
    Yields (env for clients of this head, dashboard URL).
    """
    env = env_without_ray_address(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    dashboard = free_port()
    temp_dir = Path("/tmp") / f"k3ray-{os.getpid()}"  # Ray wants a short socket path
    start = [str(BIN / "ray"), "start", "--head", "--block", "--port", str(free_port()), "--num-cpus", "2",
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard), "--include-dashboard", "true",
             "--temp-dir", str(temp_dir), "--disable-usage-stats",
             # The job agent's HTTP port is fixed (52365) by default: beside any other Ray cluster on
             # the machine it would fail to bind, and the head would refuse every job.
             "--dashboard-agent-listen-port", str(free_port())]
    log = tmp_path_factory.mktemp("ray-head") / "ray-start.log"
    with open(log, "w") as out:  # a file, not a pipe nobody reads: a full pipe would block ray start
        proc = subprocess.Popen(start, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_until_jobs_are_accepted(url, proc, log)
        yield env, url
    finally:
        tree = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # --block: ray start stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        kill_tree(tree)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory) -> list[dict]:
    """The fault-injection recipe run uninterrupted, in-process (no Ray): the engines are
    deterministic, so a run on Ray, interrupted or not, must reproduce these metrics."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_recipe(REPO / SMOKE, ARGS, run_dir, in_process=True, restart=False) == 0
    return read_metrics(run_dir / "metrics.jsonl")
