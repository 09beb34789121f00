"""`k3post`: the command line.

    k3post run RECIPE.yaml [KEY.PATH=VALUE ...] [--run-dir DIR]   train (resumes if DIR has checkpoints)
    k3post validate PATH [PATH ...]                                check recipe files or directories

User mistakes (a bad recipe, a missing file) print one clear message and exit 2; only bugs
print a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from k3post.engine.common import quiet_libraries
from k3post.config.errors import UserError

EPILOG = """examples:
  k3post run recipes/quickstart.yaml
  k3post run recipes/quickstart.yaml optim.lr=1e-5 train.steps=20 --run-dir runs/try2
  k3post validate recipes/
  ray job submit --working-dir . -- k3post run recipes/smoke/tiny.yaml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3post", description="Multi-teacher reverse-KL on-policy distillation on Ray.", epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train a recipe (resumes from the run directory's last checkpoint)",
                         description="Train a recipe. Re-running with the same --run-dir resumes from its last "
                                     "checkpoint (data position, optimizer, scheduler and RNG restored).")
    run.add_argument("recipe", help="recipe YAML, e.g. recipes/quickstart.yaml")
    run.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                     help="dotted overrides applied on top of the recipe, e.g. optim.lr=1e-5 train.steps=10")
    run.add_argument("--run-dir", type=Path, help="output directory (default: runs/<recipe name>)")
    run.add_argument("--in-process", action="store_true",
                     help="run every engine in this process, without Ray (debugging)")
    run.add_argument("--restart", action="store_true",
                     help="start over even if the run directory holds checkpoints of a different recipe")

    validate = sub.add_parser("validate", help="check recipe files (or every YAML under directories)",
                              description="Load and validate recipes; exit 0 if all are valid.")
    validate.add_argument("paths", nargs="+", help="recipe files or directories")
    return parser


def cmd_validate(args: argparse.Namespace) -> int:
    from k3post.config.load import find_recipe_files, load_recipe  # noqa: PLC0415

    files = find_recipe_files(args.paths)
    if not files:
        raise UserError(f"no YAML files found under {' '.join(args.paths)}")
    failures = 0
    for path in files:
        try:
            recipe = load_recipe(path)
            print(f"ok      {path} ({recipe.kind})")
        except UserError as err:
            failures += 1
            print(f"INVALID {err}", file=sys.stderr)
    print(f"{len(files) - failures} valid, {failures} invalid")
    return 1 if failures else 0


def cmd_run(args: argparse.Namespace) -> int:
    from k3post.cli.run import run_recipe  # noqa: PLC0415

    return run_recipe(Path(args.recipe), args.overrides, args.run_dir, args.in_process, args.restart)


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    parser = build_parser()
    # Overrides may come after options (`run R --run-dir D optim.lr=1e-5`); argparse stops
    # collecting positionals at the first option, so pick the KEY=VALUE leftovers up here.
    args, extra = parser.parse_known_args(argv)
    leftovers = [e for e in extra if e.startswith("-") or "=" not in e or args.command != "run"]
    if leftovers:
        parser.error(f"unrecognized arguments: {' '.join(leftovers)}")
    if args.command == "run":
        args.overrides = args.overrides + extra
    started = time.time()
    try:
        code = {"run": cmd_run, "validate": cmd_validate}[args.command](args)
    except UserError as err:
        print(f"k3post: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nk3post: interrupted after {time.time() - started:.0f}s; re-run the same command to resume "
              "from the last checkpoint", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
