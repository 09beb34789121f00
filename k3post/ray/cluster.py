"""Getting a Ray cluster: join one (RAY_ADDRESS, `ray.address`, inside `ray job submit`) or
start a local one.

Token authentication: Ray 2.60 turns it on for clusters it starts, writing ~/.ray/auth_token.
A driver joining an existing cluster must agree with it: RAY_AUTH_MODE (and RAY_AUTH_TOKEN /
RAY_AUTH_TOKEN_PATH) are read by Ray from the environment, so set them the same way for
`ray start`, `ray job submit` and `k3post run` (cluster/README.md). Inside a submitted job the
driver inherits the job's environment and needs nothing more. For the local cluster it starts
itself (RAY_AUTH_MODE unset), Ray turns token auth on and logs "Token authentication is enabled
for this Ray cluster" on every run: k3post drops that one line (`QuietLocalTokenAuth`), nothing
else; auth stays on, and joining a cluster logs what Ray logs.
"""

from __future__ import annotations

import json
import logging
import os

import ray

from k3post.config.schema import RaySpec
from k3post.engine.host_memory import allocator_env
from k3post.launch.describe import cpu_slots_line
from k3post.ray.weight_sync import leave_weight_groups
from k3post.track.atomic import HOLD_ENV

# Passed to every actor: quiet model loading, no hub access at run time, the same cache, and
# host memory kept between steps (engine/host_memory.py).
ACTOR_ENV_KEYS = ("K3POST_CACHE", "HF_HOME", "RAY_AUTH_MODE", HOLD_ENV)


def actor_env() -> dict[str, str]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "TOKENIZERS_PARALLELISM": "false", **allocator_env()}
    env.update({k: os.environ[k] for k in ACTOR_ENV_KEYS if k in os.environ})
    return env


def without_job_fields(runtime_env: dict, job_runtime_env: dict) -> dict:
    """`runtime_env` minus what the job's own runtime env already sets.

    Inside a Ray job, ray.init merges its runtime env into the job's and refuses any field or
    env var that both set ("Failed to merge the Job's runtime env"): `k3post submit` passes
    RAY_AUTH_MODE, `ray job submit --runtime-env-json` may pass anything. The job's values win.
    """
    job_vars = job_runtime_env.get("env_vars") or {}
    out = {k: v for k, v in runtime_env.items() if k != "env_vars" and k not in job_runtime_env}
    env_vars = {k: v for k, v in runtime_env.get("env_vars", {}).items() if k not in job_vars}
    if env_vars:
        out["env_vars"] = env_vars
    return out


def _job_runtime_env() -> dict:
    """The runtime env of the Ray job this driver runs in ({} outside a job); the job supervisor
    hands it to the driver in RAY_JOB_CONFIG_JSON_ENV_VAR."""
    raw = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    return (json.loads(raw).get("runtime_env") or {}) if raw else {}


TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class QuietLocalTokenAuth(logging.Filter):
    """Drops Ray's notice that it enabled token auth by default for a local cluster."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def connect(spec: RaySpec, cpus_needed: float, placement: bool = False) -> str:
    """Join or start Ray; returns a one-line description for the log (placement: `cpus_needed`
    sums the run's placement group's bundles)."""
    if ray.is_initialized():
        return "using the Ray cluster this process is already connected to"
    address = spec.address or os.environ.get("RAY_ADDRESS")
    runtime_env = without_job_fields(
        {"env_vars": actor_env(), "worker_process_setup_hook": "k3post.engine.common.quiet_libraries"},
        _job_runtime_env())
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
        return f"joined the Ray cluster at {address}"
    # Logical CPUs: the phases of a synchronous step run one after another, so actors may
    # share cores; ask for enough slots to place every actor.
    num_cpus = spec.num_cpus or max(int(cpus_needed + 0.999), os.cpu_count() or 1)
    object_store = spec.object_store_mb * 1024 * 1024 if spec.object_store_mb else None
    # address="local": always a fresh cluster of our own. Without it Ray joins the last cluster
    # `ray start` left on this machine (/tmp/ray/ray_current_cluster), someone else's or a dead one.
    # The processes of a local cluster share the driver's fate: if the driver is killed, Ray's
    # GCS, raylet and actors exit with it, and a re-run starts a new cluster and resumes.
    quiet = QuietLocalTokenAuth()
    logging.getLogger(TOKEN_AUTH_LOGGER).addFilter(quiet)
    try:
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, object_store_memory=object_store,
                 runtime_env=runtime_env, log_to_driver=True)
    finally:
        logging.getLogger(TOKEN_AUTH_LOGGER).removeFilter(quiet)
    line = cpu_slots_line(num_cpus, spec.num_cpus, cpus_needed, os.cpu_count() or 1, placement)
    return f"started a local Ray cluster: {line}"


def disconnect() -> None:
    if ray.is_initialized():
        leave_weight_groups()
        ray.shutdown()
