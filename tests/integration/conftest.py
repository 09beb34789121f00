"""Fixtures of the integration tests: one real Ray head with token auth, shared by every test of
tests/integration/ that needs only *a* cluster (jobs submitted to it, `k3post run` joining it by
RAY_ADDRESS, this process attached to it as a driver for a module), and the reference metrics that
interrupted runs must reproduce.

Tests that kill a node, an actor or the head, or need a cluster of another shape (fake GPUs,
several nodes), or prove that a run starts a local cluster of its own, start their own."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from k3post.cli.run import run_recipe
from k3post.config.schema import RaySpec
from k3post.ray.cluster import connect, disconnect
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


# A run of the smoke recipes asks for 2 CPU slots (learner, sampler and two teachers at 0.5 each:
# launch/engines.py cpus_needed); the head has those and no more, as a local cluster of this
# 2-core machine would. Runs that ask for more (2 learner ranks) start their own cluster.
HEAD_CPUS = 2


@dataclass(frozen=True)
class Head:
    env: dict[str, str]  # for clients of this head: token auth on, this head's token
    url: str  # the dashboard: jobs are submitted here
    address: str  # the GCS: drivers join here (RAY_ADDRESS)

    def join_env(self, **extra: str) -> dict[str, str]:
        """The environment of a `k3post run` that joins this head (k3post/ray/cluster.py: connect)."""
        return {**self.env, "RAY_ADDRESS": self.address, **extra}


@pytest.fixture(scope="package")
def shared_head(tmp_path_factory):
    """A real head node, token auth on, shared by the tests of tests/integration/ (package scope:
    stopped after the last of them, so that the unit tests run without its idle processes).

    Started with `ray start --block` so that teardown can stop exactly this head (and whatever
    its jobs started) by pid: `ray stop` would stop every Ray cluster of the user on the machine.
    """
    env = env_without_ray_address(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    dashboard, port = free_port(), free_port()
    temp_dir = Path("/tmp") / f"k3ray-{os.getpid()}"  # Ray wants a short socket path
    start = [str(BIN / "ray"), "start", "--head", "--block", "--port", str(port), "--num-cpus", str(HEAD_CPUS),
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
        # `ray start` prints how to join it: `ray start --address='<node ip>:<port>'`.
        found = re.search(r"--address='([^']+)'", log.read_text())
        assert found, log.read_text()[-3000:]
        yield Head(env, url, found.group(1))
    finally:
        tree = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)  # --block: ray start stops the processes it started
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        kill_tree(tree)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="package")
def ray_head(shared_head):
    """The shared head for job clients: (env for clients of this head, dashboard URL)."""
    return shared_head.env, shared_head.url


@contextmanager
def _driver_on(head: Head, as_k3post: bool):
    """This process attached to `head` as a Ray driver, then detached (its actors end with it), so
    that a later module may start a cluster of its own. `as_k3post`: the way `k3post run` joins a
    cluster (RAY_ADDRESS, then `connect`: k3post's actor environment and worker setup hook);
    otherwise a plain `ray.init` (stand-in actors that import nothing of k3post).

    Ray reads the auth mode and token once and caches them: they are refreshed after the
    environment changes, on the way in and on the way out."""
    import ray
    from ray._private.authentication_test_utils import reset_auth_token_state

    names = ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    os.environ.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=TOKEN)
    if as_k3post:
        os.environ["RAY_ADDRESS"] = head.address
    reset_auth_token_state()
    try:
        if as_k3post:
            line = connect(RaySpec(), 0)
            assert line == f"joined the Ray cluster at {head.address}", line
        else:
            ray.init(address=head.address)
        yield head
    finally:
        disconnect()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reset_auth_token_state()


@pytest.fixture(scope="module")
def ray_driver(shared_head):
    """This process as a driver of the shared head for one module, joined as `k3post run` joins."""
    with _driver_on(shared_head, as_k3post=True) as head:
        yield head


@pytest.fixture(scope="module")
def bare_ray_driver(shared_head):
    """This process as a plain Ray driver of the shared head for one module (stand-in actors)."""
    with _driver_on(shared_head, as_k3post=False) as head:
        yield head


@pytest.fixture(scope="session")
def tiny_reference(tmp_path_factory) -> list[dict]:
    """The fault-injection recipe run uninterrupted, in-process (no Ray): the engines are
    deterministic, so a run on Ray, interrupted or not, must reproduce these metrics."""
    run_dir = tmp_path_factory.mktemp("reference")
    assert run_recipe(REPO / SMOKE, ARGS, run_dir, in_process=True, restart=False) == 0
    return read_metrics(run_dir / "metrics.jsonl")
