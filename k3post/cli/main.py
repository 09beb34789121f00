"""`k3post`: the command line.

    k3post run RECIPE.yaml [KEY.PATH=VALUE ...] [--run-dir DIR]   train (resumes if DIR has checkpoints)
    k3post run PIPELINE.yaml [--run-dir DIR]                       stages in order, e.g. SFT -> OPD -> eval
    k3post validate PATH [PATH ...]                                check recipe files or directories
    k3post plan RECIPE.yaml [KEY.PATH=VALUE ...] --gpus-per-node N --gpu-memory GiB [--nodes M]
                                                                   size a run before launching it (docs/sizing.md)
    k3post submit RECIPE.yaml [KEY.PATH=VALUE ...] [--address URL]  run a recipe as a job on a Ray cluster
    k3post eval EVAL.yaml [KEY.PATH=VALUE ...] [--out DIR]          evaluate students and teachers (docs/eval.md)
    k3post transplant OUT_DIR [--base B] [--tokenizer DIR | --vocab-size N --corpus F ...]
                                                                   a model under a new tokenizer (docs/transplant.md)

Errors (docs/recipes.md, "Errors"): a mistake in the user's input (recipe, data, model or run
directory, command line) prints one message, `k3post: error: FILE[: KEY.PATH | : row N]: what was
expected (got …)`, and exits 2, with no traceback. Anything else is a bug in k3post: its traceback
is printed, followed by how to report it, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from k3post.engine.common import quiet_libraries
from k3post.config.errors import RunStopped, UserError

EPILOG = """examples:
  k3post run recipes/quickstart.yaml
  k3post run recipes/quickstart.yaml optim.lr=1e-5 train.steps=20 --run-dir runs/try2
  k3post run recipes/pipelines/smoke-tiny.yaml        # SFT -> OPD -> eval, each stage in its own directory
  k3post run recipes/quickstart.yaml sampling.engine=vllm teachers.chat.engine=vllm teachers.math.engine=vllm
  k3post eval recipes/eval/smoke-tiny.yaml --out runs/eval/smoke
  k3post validate recipes/
  k3post plan examples/sizing/8b-two-32b-teachers.yaml --nodes 2 --gpus-per-node 8 --gpu-memory 80
  k3post transplant runs/smol-12k --keep-layers 0-11,18-29   # SmolLM2's body under a new 12k-token BPE
  k3post submit recipes/smoke/tiny.yaml --address http://127.0.0.1:8265 --run-dir /shared/runs/tiny --follow
  ray job submit --working-dir . -- k3post run recipes/smoke/tiny.yaml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="k3post", description="Post-training after the Kimi K3 recipe: multi-teacher reverse-KL on-policy "
                                     "distillation, SFT with FP8 QAT, RL from rewards, evaluation — on Ray.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="train a recipe, or run a pipeline of stages (resumes where it stopped)",
                         description="Train a recipe. Re-running with the same --run-dir resumes from its last "
                                     "checkpoint (data position, optimizer, scheduler and RNG restored).")
    run.add_argument("recipe", help="recipe YAML (sft, distill, rl or pipeline), e.g. recipes/quickstart.yaml")
    run.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE",
                     help="dotted overrides applied on top of the recipe, e.g. optim.lr=1e-5 train.steps=10")
    run.add_argument("--run-dir", type=Path, help="output directory (default: runs/<recipe name>)")
    run.add_argument("--in-process", action="store_true",
                     help="run every engine in this process, without Ray (debugging)")
    run.add_argument("--restart", action="store_true",
                     help="start over even if the run directory holds checkpoints of a different recipe")

    export = sub.add_parser("export-fp8", help="write an FP8 (compressed-tensors) checkpoint vLLM serves",
                            description="Quantize a checkpoint's Linear layers to FP8 e4m3 with one scale per "
                                        "row (the scheme FP8 QAT trains under) and write a compressed-tensors "
                                        "checkpoint with dynamic per-token FP8 activations. Prints what it quantised per kind of "
                                        "tensor, the held-out NLL of the export against the checkpoint, and a "
                                        "warning when the checkpoint was not trained with FP8 QAT.")
    export.add_argument("checkpoint", type=Path, help="an HF checkpoint directory, e.g. runs/x/checkpoints/step-20")
    export.add_argument("out", type=Path, help="output directory")
    export.add_argument("--nll-replies", type=int, default=32, metavar="N",
                        help="measure the held-out NLL of the export against the checkpoint on N replies of "
                             "builtin:reference, paired (default 32; 0: do not measure)")

    draft = sub.add_parser("export-draft", help="write the student and its MTP draft head as a checkpoint vLLM "
                                               "serves with speculative decoding (method mtp)",
                           description="Write a checkpoint trained with `draft: {kind: mtp, hidden: residual}` as a "
                                       "MiMoForCausalLM checkpoint (the student in Qwen2's layers, the head as its "
                                       "MTP layer 0), which vLLM serves with speculative_config {\"method\": \"mtp\"}. "
                                       "Students of the llama, mistral, qwen2 and qwen3 families.")
    draft.add_argument("checkpoint", type=Path, help="a run checkpoint with mtp_head.safetensors, e.g. "
                                                     "runs/x/checkpoints/step-20")
    draft.add_argument("out", type=Path, help="output directory")

    validate = sub.add_parser("validate", help="check recipe files (or every YAML under directories)",
                              description="Load and validate recipes, and for training recipes the model "
                                          "directories they name (headers only) and every row of their data "
                                          "(rows, held-out split, fields, prompts that look already rendered); "
                                          "each file is reported. Dotted overrides apply as they do for run. "
                                          "Exit 0 if all are valid, 1 if any is not.")
    validate.add_argument("paths", nargs="+", metavar="PATH | KEY.PATH=VALUE",
                          help="recipe files or directories, and dotted overrides (as for run)")
    validate.add_argument("--recipe-only", action="store_true",
                          help="check the recipes alone, not the models and data they name")
    _add_submit(sub)
    _add_eval(sub)
    from k3post.cli.plan import add_plan  # noqa: PLC0415

    add_plan(sub)
    from k3post.cli.transplant import add_transplant  # noqa: PLC0415

    add_transplant(sub)
    return parser


def _add_eval(sub) -> None:
    evaluate = sub.add_parser(
        "eval", help="evaluate students (run checkpoints, HF dirs, FP8 exports) and teachers; write a report",
        description="Evaluate the models of an eval recipe (recipes/eval/) on its tasks: pass@k with verifiers, "
                    "exact KL to each teacher, NLL, FP8 serving gap. Writes report.json, report.md and plots/. "
                    "Exit 0: all evaluated; 1: the report lists failures; 2: the recipe could not be read.")
    evaluate.add_argument("recipe", help="eval recipe YAML, e.g. recipes/eval/smoke-tiny.yaml")
    evaluate.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="dotted overrides, e.g. seed=1")
    evaluate.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY.PATH=VALUE",
                          help="a dotted override (repeatable), same as a positional one")
    evaluate.add_argument("--out", type=Path, help="report directory (default: runs/eval/<recipe name>)")
    evaluate.add_argument("--card", action="store_true",
                          help="append each student checkpoint's results to its README.md model card")


def _add_submit(sub) -> None:
    submit = sub.add_parser(
        "submit", help="run a recipe as a job on a running Ray cluster (ray job submit, with checks)",
        description="Validate a recipe here, upload the current directory (without .venv, runs, .git, "
                    "__pycache__) and submit `k3post run RECIPE` as a Ray job. Exit code: 0 when the job "
                    "succeeded (with --no-wait: was accepted), 1 when it failed or was stopped. Resubmitting "
                    "with the same --run-dir resumes from its last checkpoint.",
        epilog="Token authentication (Ray 2.60 default): set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or "
               "RAY_AUTH_TOKEN_PATH) as the cluster has them. See cluster/README.md.")
    submit.add_argument("recipe", help="recipe YAML inside the current directory, e.g. recipes/quickstart.yaml")
    submit.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="dotted overrides, as for run")
    submit.add_argument("--address", help="the cluster's dashboard, e.g. http://HEAD:8265 (default: "
                                          "RAY_API_SERVER_ADDRESS or RAY_ADDRESS, else a head on this machine)")
    submit.add_argument("--run-dir", help="output directory as the cluster sees it; use shared storage so that "
                                          "it survives the job and a resubmission resumes")
    wait = submit.add_mutually_exclusive_group()
    wait.add_argument("--follow", action="store_true", help="stream the job's logs until it ends")
    wait.add_argument("--no-wait", action="store_true", help="return once the job is accepted")
    submit.add_argument("--dry-run", action="store_true",
                        help="check the recipe, its paths and the options; print the job; contact no cluster")
    submit.add_argument("--allow-outside", action="store_true",
                        help="paths the recipe names outside the uploaded directory exist on the cluster at the "
                             "same paths (shared storage)")
    submit.add_argument("--k3post", metavar="PATH", help="the k3post executable on the cluster (default: this "
                                                         "environment's, %(default)s)",
                        default=str(Path(sys.executable).parent / "k3post"))


def cmd_validate(args: argparse.Namespace) -> int:
    from k3post.config.load import find_recipe_files, load_recipe  # noqa: PLC0415

    # KEY.PATH=VALUE arguments are overrides (as for run); a file whose name holds '=' stays a path.
    overrides = [p for p in args.paths if "=" in p and not Path(p).exists()]
    paths = [p for p in args.paths if p not in overrides]
    files = find_recipe_files(paths)
    if not files:
        raise UserError(f"no YAML files found under {' '.join(paths)}")
    failures = 0
    for path in files:
        try:
            recipe = load_recipe(path, overrides)
            details = []
            from k3post.cli.references import check_references  # noqa: PLC0415

            check_references(recipe, path)  # names the recipe itself gives: --recipe-only checks them too
            if recipe.kind in ("distill", "sft", "rl") and not args.recipe_only:
                from k3post.cli.inputs import check_models, describe_data  # noqa: PLC0415

                check_models(recipe)
                details = describe_data(recipe)
            print(f"ok      {path} ({recipe.kind})")
            for line in details:
                print(line)
        except UserError as err:
            failures += 1
            print(f"INVALID {err}", file=sys.stderr)
    print(f"{len(files) - failures} valid, {failures} invalid")
    return 1 if failures else 0


def _export_draft(args: argparse.Namespace) -> int:
    from k3post.cli.export import cmd_export_draft  # noqa: PLC0415

    return cmd_export_draft(args)


def _export_fp8(args: argparse.Namespace) -> int:
    from k3post.cli.export import cmd_export_fp8  # noqa: PLC0415

    if args.nll_replies < 0:
        raise UserError(f"--nll-replies {args.nll_replies}: expected 0 (do not measure) or a number of replies")
    return cmd_export_fp8(args)


def cmd_eval(args: argparse.Namespace) -> int:
    from k3post.cli.eval import run_eval  # noqa: PLC0415

    return run_eval(Path(args.recipe), args.overrides + args.sets, args.out, args.card)


def cmd_run(args: argparse.Namespace) -> int:
    from k3post.cli.run import run_recipe  # noqa: PLC0415
    from k3post.config.load import read_yaml  # noqa: PLC0415

    if read_yaml(Path(args.recipe)).get("kind") == "pipeline":
        from k3post.cli.pipeline import run_pipeline  # noqa: PLC0415

        if args.overrides:
            raise UserError("a pipeline takes overrides per stage (stages[i].overrides in its YAML), not on the "
                            "command line")
        return run_pipeline(Path(args.recipe), args.run_dir, args.in_process, args.restart)
    return run_recipe(Path(args.recipe), args.overrides, args.run_dir, args.in_process, args.restart)


def cmd_plan(args: argparse.Namespace) -> int:
    from k3post.cli.plan import cmd_plan as plan  # noqa: PLC0415

    return plan(args)


def cmd_transplant(args: argparse.Namespace) -> int:
    from k3post.cli.transplant import cmd_transplant as transplant  # noqa: PLC0415

    return transplant(args)


def cmd_submit(args: argparse.Namespace) -> int:
    from k3post.cli.submit import SubmitOptions, submit_recipe  # noqa: PLC0415

    return submit_recipe(SubmitOptions(Path(args.recipe), args.overrides, args.address, args.run_dir, args.follow,
                                       args.no_wait, args.k3post, args.dry_run, args.allow_outside))


def main(argv: list[str] | None = None) -> int:
    quiet_libraries()
    parser = build_parser()
    # Overrides may come after options (`run R --run-dir D optim.lr=1e-5`); argparse stops
    # collecting positionals at the first option, so pick the KEY=VALUE leftovers up here.
    args, extra = parser.parse_known_args(argv)
    takes_overrides = args.command in ("run", "submit", "eval", "validate", "plan")
    leftovers = [e for e in extra if e.startswith("-") or "=" not in e or not takes_overrides]
    if leftovers:
        parser.error(f"unrecognized arguments: {' '.join(leftovers)}")
    if args.command == "validate":  # its positionals hold paths and overrides alike (cmd_validate splits them)
        args.paths = args.paths + extra
    elif takes_overrides:
        args.overrides = args.overrides + extra
    started = time.time()
    try:
        code = {"run": cmd_run, "validate": cmd_validate, "submit": cmd_submit,
                "export-fp8": _export_fp8, "export-draft": _export_draft, "eval": cmd_eval,
                "transplant": cmd_transplant,
                "plan": cmd_plan}[args.command](args)
    except KeyboardInterrupt:
        print(f"\nk3post: interrupted after {time.time() - started:.0f}s; re-run the same command to resume "
              "from the last checkpoint", file=sys.stderr)
        return 130
    except Exception as err:  # noqa: BLE001 - the one place errors meet the user
        return print_error(err)
    return code


REPORT = ("k3post: internal error: this is a bug in k3post, not a mistake in your input. Please report it "
          "(an issue on the project's tracker) with the command you ran, the recipe, the traceback above "
          "and `pip show k3post` (its version).")


def _user_error_in(err: BaseException) -> UserError | None:
    """A UserError raised inside a Ray actor or task reaches the driver wrapped (RayTaskError's
    `cause`, or `__cause__`); find it so it prints as the user's mistake it is."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, UserError):
            return err
        err, seen = getattr(err, "cause", None) or err.__cause__, seen + 1
    return None


def print_error(err: Exception) -> int:
    """The one error printer: a user's mistake is one message and exit 2; a dead Ray actor one
    line and exit 1; anything else a bug: its traceback, how to report it, exit 1."""
    user = _user_error_in(err)
    if user is not None:
        print(f"k3post: error: {user}", file=sys.stderr)
        return 2
    if isinstance(err, RunStopped):
        print(f"k3post: error: {err}", file=sys.stderr)
        return 1
    if type(err).__module__.startswith("ray.") and type(err).__name__ in (
            "ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError", "OutOfMemoryError",
            "NodeDiedError", "ObjectLostError"):
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"k3post: error: a Ray process of the run died ({type(err).__name__}: {first[:300]}); re-run the same "
              "command to resume from the last checkpoint (the Ray logs under /tmp/ray/session_latest/logs say why)",
              file=sys.stderr)
        return 1
    traceback.print_exception(err)
    print(REPORT, file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
