"""A local run is quiet about Ray's token authentication (issue 21): the one line Ray logs when
it turns token auth on for a local cluster is dropped; auth itself stays on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import os
from k3post.config.schema import RaySpec
from k3post.ray.cluster import connect, disconnect
connect(RaySpec(num_cpus=1, object_store_mb=100), 1)
print("MODE", os.environ.get("RAY_AUTH_MODE"))
disconnect()
"""


def _start_local(tmp_path, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    environ.update(HOME=str(tmp_path), **env)  # ~/.ray/auth_token of its own
    return subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=environ, timeout=300)


def test_a_local_cluster_starts_with_token_auth_and_no_warning(tmp_path):
    done = _start_local(tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MODE token" in done.stdout  # Ray turned token auth on, as it does for a local cluster
    assert "Token authentication is enabled" not in done.stdout + done.stderr
    assert (tmp_path / ".ray" / "auth_token").is_file()  # auth is on: Ray made the cluster's token
