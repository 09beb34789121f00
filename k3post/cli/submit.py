"""`k3post submit`: run a recipe as a Ray job on a running cluster.

    k3post submit RECIPE.yaml [KEY.PATH=VALUE ...] [--address URL] [--run-dir DIR] [--follow | --no-wait]

A thin wrapper over Ray's job client (k3post/ray/jobs.py), doing what
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

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from k3post.config.errors import UserError

EXCLUDES = [".venv", "runs", ".git", "__pycache__"]
# Passed on to the job when set here: the job's ray calls must agree with the cluster on auth.
FORWARDED_ENV = ("RAY_AUTH_MODE",)


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
    from k3post.cli.inputs import model_specs, transplant_files  # noqa: PLC0415

    found = {}
    for where, spec in model_specs(recipe).items():
        for key in ("path", "gguf"):
            if getattr(spec, key) is not None:
                found[f"{where}.{key}"] = getattr(spec, key)
        found.update({f"{where}.{key}": path for key, path in transplant_files(spec).items()})
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


def submit_recipe(opts: SubmitOptions) -> int:
    from k3post.config.load import load_run_recipe  # noqa: PLC0415

    if opts.follow and opts.no_wait:
        raise UserError("--follow and --no-wait contradict each other; give one")
    recipe_rel = recipe_in_working_dir(opts.recipe, Path.cwd())
    recipe = load_run_recipe(opts.recipe, opts.overrides)  # a bad recipe fails here, not on the cluster
    from k3post.cli.references import check_references  # noqa: PLC0415

    check_references(recipe, opts.recipe)  # so does a reward function or prompt set it misnames
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
    from k3post.ray.jobs import connect, follow, report, submit, wait_for_end  # noqa: PLC0415

    client = connect(opts.address)
    job_id = submit(client, entrypoint(opts, recipe_rel), runtime_env())
    print(f"k3post: submitted {job_id} to {client.get_address()}: {entrypoint(opts, recipe_rel)}", flush=True)
    if opts.no_wait:
        print(f"k3post: follow it with `ray job logs -f {job_id}`, stop it with `ray job stop {job_id}`")
        return 0
    try:
        if opts.follow:
            follow(client, job_id)
        return report(client, job_id, wait_for_end(client, job_id), printed_logs=opts.follow)
    except KeyboardInterrupt:
        print(f"\nk3post: stopped watching; the job keeps running. `ray job logs -f {job_id}` follows it, "
              f"`ray job stop {job_id}` stops it", file=sys.stderr)
        return 130
