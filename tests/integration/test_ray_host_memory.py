"""Every Ray actor starts with k3post's host-allocator settings (engine/host_memory.py), and they
do what they are there for: a large tensor allocated again and again stops faulting its memory in
4 KiB at a time. Measured against a worker of the same cluster started with glibc's defaults.
The driver joins the shared head of conftest.py as `k3post run` does (RAY_ADDRESS): the settings
travel in the job's runtime env, whichever cluster the job runs on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from k3post.engine.host_memory import ALLOCATOR_TUNABLES

pytestmark = pytest.mark.integration

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")

SCRIPT = """
import os, resource
import ray
from k3post.config.schema import RaySpec
from k3post.ray.cluster import connect, disconnect

@ray.remote(num_cpus=0)
def faults():
    import torch
    torch.ones(1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        x = torch.ones(16 * 2**20)  # 64 MiB, written: over glibc's largest mmap threshold
        del x
    return os.environ.get("GLIBC_TUNABLES"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

print("JOINED" if connect(RaySpec(num_cpus=1, object_store_mb=100), 1).startswith("joined") else "STARTED")
print("TUNED", *ray.get(faults.remote()))
print("DEFAULT", *ray.get(faults.options(runtime_env={"env_vars": {"GLIBC_TUNABLES": ""}}).remote()))
disconnect()
"""


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here")
def test_actors_start_with_the_allocator_settings_and_fault_far_less(shared_head, tmp_path):
    environ = {k: v for k, v in shared_head.join_env().items() if k != "GLIBC_TUNABLES"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300,
                          env={**environ, "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "JOINED" in done.stdout, done.stdout[-2000:]
    lines = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines()
             if line.startswith(("TUNED", "DEFAULT"))}
    assert lines["TUNED"][0] == ALLOCATOR_TUNABLES
    tuned, default = int(lines["TUNED"][-1]), int(lines["DEFAULT"][-1])
    assert default > 5 * 16_000 * 0.9  # glibc's defaults: 64 MiB / 4 KiB faults, each of the 5 times
    assert tuned < default / 20, (tuned, default)
