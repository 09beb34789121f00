"""`k3post submit`: run a recipe as a Ray job on a running cluster.

    k3post submit RECIPE.yaml [KEY.PATH=VALUE ...] [--address URL] [--run-dir DIR] [--follow | --no-wait]

A thin wrapper over `ray.job_submission.JobSubmissionClient`, doing what
`ray job submit --working-dir . -- k3post run RECIPE.yaml` does (which keeps working), plus:

- the recipe and its overrides are validated here first, so a typo fails in a second instead of
  after an upload and a cluster-side start;
- the current directory is uploaded as the job's working_dir without `.venv`, `runs`, `.git`
  and `__pycache__` (a venv alone can exceed Ray's upload limit);
- the entrypoint names a k3post executable, because it runs with the head's PATH, which need
  not have one (REFERENCE §7.4); by default this environment's, right for a head on this
  machine or an image that installs the project at the same path; `--k3post` names another;
- RAY_AUTH_MODE, if set here, is passed to the job. The token never is: it is the cluster's
  secret, and the job already runs inside the cluster;
- every file the recipe names (models, teacher models, data, reward models) must be inside the
  uploaded directory and not under an excluded one (`runs/`, `.venv`, ...): a path elsewhere
  validates here and then fails on the cluster. Such paths are an error before anything is sent,
  unless `--allow-outside` says the cluster mounts them at the same path (shared storage);
- `--dry-run` does every check, prints the job it would submit, and contacts no cluster.

Exit code: 0 when the job succeeded (with --no-wait: was accepted), 1 when it failed or was
stopped, 2 for a mistake on this side (bad recipe, unreachable or refusing cluster).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from k3post.config.errors import UserError

EXCLUDES = [".venv", "runs", ".git", "__pycache__"]
# Passed on to the job when set here: the job's ray calls must agree with the cluster on auth.
FORWARDED_ENV = ("RAY_AUTH_MODE",)
ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


@dataclass
class SubmitOptions:
    recipe: Path
    overrides: list[str] = field(default_factory=list)
    address: str | None = None
    run_dir: str | None = None
    follow: bool = False
    no_wait: bool = False
    k3post: str = str(Path(sys.executable).parent / "k3post")
    dry_run: bool = False
    allow_outside: bool = False


def recipe_in_working_dir(recipe: Path, working_dir: Path) -> str:
    """The recipe's path relative to the uploaded directory: the job sees only that copy."""
    try:
        return str(recipe.resolve().relative_to(working_dir.resolve()))
    except ValueError:
        raise UserError(f"{recipe}: the recipe must be inside the current directory ({working_dir}), which is "
                        f"uploaded as the job's working directory; cd to the project and submit from there") from None


def recipe_paths(recipe) -> dict[str, str]:
    """Every file or directory a loaded training recipe names, by key path (absolute already)."""
    from k3post.cli.inputs import model_specs  # noqa: PLC0415

    found = {}
    for where, spec in model_specs(recipe).items():
        for key in ("path", "gguf"):
            if getattr(spec, key) is not None:
                found[f"{where}.{key}"] = getattr(spec, key)
    for name, rm in (getattr(recipe, "reward_models", None) or {}).items():
        if rm.path is not None:
            found[f"reward_models.{name}.path"] = rm.path
    for i, source in enumerate(recipe.data.sources):
        value = getattr(source, "examples", None) or getattr(source, "prompts", None)
        if value and not value.startswith("builtin:"):
            found[f"data.sources[{i}]"] = value
    return found


def paths_not_uploaded(recipe, working_dir: Path) -> list[str]:
    """`key: path (why)` for each path the job will not see: outside the working directory, or
    inside one of the EXCLUDES that are not uploaded."""
    root = working_dir.resolve()
    problems = []
    for where, value in recipe_paths(recipe).items():
        path = Path(value).resolve()
        try:
            rel = path.relative_to(root)
        except ValueError:
            problems.append(f"{where}: {path} (outside {root})")
            continue
        excluded = next((part for part in rel.parts if part in EXCLUDES), None)
        if excluded is not None:
            problems.append(f"{where}: {path} (under {excluded}/, which is not uploaded)")
    return problems


def check_uploaded_paths(recipe, opts: SubmitOptions, working_dir: Path) -> None:
    problems = paths_not_uploaded(recipe, working_dir)
    if not problems:
        return
    listing = "\n  ".join(problems)
    if opts.allow_outside:
        print(f"k3post: note: --allow-outside: the cluster must have these at the same paths:\n  {listing}",
              file=sys.stderr)
        return
    raise UserError(f"{opts.recipe}: the recipe names files the job will not have: `k3post submit` uploads only "
                    f"the working directory ({working_dir.resolve()}), without {', '.join(EXCLUDES)}:\n  {listing}\n"
                    "Move them into the project, or, if the cluster mounts them at the same paths (shared "
                    "storage), pass --allow-outside")


def entrypoint(opts: SubmitOptions, recipe_rel: str) -> str:
    command = [opts.k3post, "run", recipe_rel, *opts.overrides]
    if opts.run_dir:
        command += ["--run-dir", opts.run_dir]
    return shlex.join(command)


def runtime_env() -> dict:
    env_vars = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    return {"working_dir": ".", "excludes": list(EXCLUDES), "env_vars": env_vars}


@contextmanager
def _address_wins(address: str | None) -> Iterator[None]:
    """Ray lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override an explicit address; an explicit
    --address should win, so hide them while the client is made."""
    saved = {k: os.environ.pop(k) for k in ADDRESS_ENV if address and k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def connect(address: str | None):
    from ray.exceptions import AuthenticationError  # noqa: PLC0415
    from ray.job_submission import JobSubmissionClient  # noqa: PLC0415

    where = address or os.environ.get("RAY_API_SERVER_ADDRESS") or os.environ.get("RAY_ADDRESS") or "a local head"
    try:
        with _address_wins(address):
            return JobSubmissionClient(address)
    except AuthenticationError as err:
        raise UserError(f"the Ray cluster at {where} refused this client ({str(err).splitlines()[0]}). "
                        "Set RAY_AUTH_MODE=token and the cluster's token in RAY_AUTH_TOKEN or "
                        "RAY_AUTH_TOKEN_PATH (cluster/README.md)") from None
    except ConnectionError as err:
        raise UserError(f"could not reach a Ray dashboard at {where} ({err}). Pass --address "
                        "http://HEAD:8265 (or set RAY_ADDRESS), or start a head: cluster/README.md") from None


def submit(client, opts: SubmitOptions, recipe_rel: str) -> str:
    from ray.exceptions import AuthenticationError  # noqa: PLC0415

    try:
        return client.submit_job(entrypoint=entrypoint(opts, recipe_rel), runtime_env=runtime_env())
    except AuthenticationError as err:
        raise UserError(f"the Ray cluster refused the job ({str(err).splitlines()[0]}); set RAY_AUTH_MODE "
                        "and RAY_AUTH_TOKEN as the cluster has them") from None


async def _tail(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        print(chunk, end="", flush=True)


def wait_for_end(client, job_id: str, poll_s: float = 1.0) -> str:
    """Poll until the job is in a terminal state; returns the status name."""
    while True:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            return status.value
        time.sleep(poll_s)


def _report(client, job_id: str, status: str, printed_logs: bool) -> int:
    info = client.get_job_info(job_id)
    if status == "SUCCEEDED":
        print(f"k3post: job {job_id} succeeded")
        return 0
    if not printed_logs:  # the end of the logs says why; the whole is one command away
        tail = client.get_job_logs(job_id).splitlines()[-30:]
        print("\n".join(tail), file=sys.stderr)
    print(f"k3post: job {job_id} {status}: {info.message or ''}".rstrip(), file=sys.stderr)
    return 1


def submit_recipe(opts: SubmitOptions) -> int:
    from k3post.config.load import load_run_recipe  # noqa: PLC0415

    if opts.follow and opts.no_wait:
        raise UserError("--follow and --no-wait contradict each other; give one")
    recipe_rel = recipe_in_working_dir(opts.recipe, Path.cwd())
    recipe = load_run_recipe(opts.recipe, opts.overrides)  # a bad recipe fails here, not on the cluster
    check_uploaded_paths(recipe, opts, Path.cwd())
    if not opts.run_dir:
        print("k3post: note: no --run-dir: outputs go to the job's temporary working directory on the cluster; "
              "pass a directory on shared storage to keep them and to resume", file=sys.stderr)
    elif not os.path.isabs(opts.run_dir):
        print(f"k3post: note: --run-dir {opts.run_dir} is relative to the job's temporary working directory "
              "on the cluster; an absolute path on shared storage survives the job and lets a resubmission resume",
              file=sys.stderr)
    if opts.dry_run:
        print(f"k3post: dry run: would submit `{entrypoint(opts, recipe_rel)}` with runtime_env {runtime_env()}; "
              "nothing was sent")
        return 0
    client = connect(opts.address)
    job_id = submit(client, opts, recipe_rel)
    print(f"k3post: submitted {job_id} to {client.get_address()}: {entrypoint(opts, recipe_rel)}", flush=True)
    if opts.no_wait:
        print(f"k3post: follow it with `ray job logs -f {job_id}`, stop it with `ray job stop {job_id}`")
        return 0
    try:
        if opts.follow:
            asyncio.run(_tail(client, job_id))
        return _report(client, job_id, wait_for_end(client, job_id), printed_logs=opts.follow)
    except KeyboardInterrupt:
        print(f"\nk3post: stopped watching; the job keeps running. `ray job logs -f {job_id}` follows it, "
              f"`ray job stop {job_id}` stops it", file=sys.stderr)
        return 130
