"""On a real local Ray cluster: the CLI's 2-step distill run over actors, the same run with the
weights broadcast over a torch.distributed group, and `ray job submit` of the recipe against a
head started here, with Ray's token authentication on."""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from k3post.track.metrics import read_metrics
from tests.integration.helpers import ARGS, BIN, REPO, SMOKE, assert_same_run, env_without_ray_address

pytestmark = pytest.mark.integration


def test_collective_weight_transport_reproduces_the_in_process_run(tmp_path, tiny_reference):
    """`k3post run` on a local Ray cluster it starts itself, five steps whose weights reach the
    sampler actor only through the gloo broadcast group: any stale, partial or mangled sync would
    change every metric after the first step. (The default object-store transport runs the same
    command in tests/integration/test_faults.py and test_ray_learner_ranks.py.)"""
    run_dir = tmp_path / "run"
    result = subprocess.run([str(BIN / "k3post"), "run", SMOKE, *ARGS, "sampling.weight_transport=collective",
                             "--run-dir", str(run_dir)], cwd=REPO, env=env_without_ray_address(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "started a local Ray cluster" in result.stdout
    assert "weights reach the samplers via collective (samplers are not restarted)" in result.stdout
    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert {"distill/kl/alpha", "distill/kl/beta", "time/sync_s"} <= set(metrics[1])
    assert_same_run(metrics, tiny_reference)
    assert (run_dir / "checkpoints" / f"step-{metrics[-1]['step']}" / "COMPLETE").is_file()


def test_ray_job_submit_against_a_real_head(ray_head, tmp_path):
    env, address = ray_head
    run_dir = tmp_path / "job-run"
    # The entrypoint runs with the head's PATH: name the venv's k3post explicitly.
    submit = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
              "--runtime-env-json", json.dumps({"excludes": ["runs", ".venv", ".git"]}), "--",
              str(BIN / "k3post"), "run", SMOKE, "--run-dir", str(run_dir)]
    started = time.time()
    result = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "joined the Ray cluster" in result.stdout
    assert "succeeded" in result.stdout.lower()
    assert [m["step"] for m in read_metrics(run_dir / "metrics.jsonl")] == [0, 1, 2]
    # Without the token the same head refuses the client: auth really is on.
    no_token = {k: v for k, v in env.items() if k not in ("RAY_AUTH_TOKEN",)}
    no_token["RAY_AUTH_MODE"] = "disabled"
    denied = subprocess.run([str(BIN / "ray"), "job", "list", "--address", address], env=no_token,
                            capture_output=True, text=True, timeout=120)
    assert denied.returncode != 0
    print(f"job submit round trip: {time.time() - started:.0f}s")
