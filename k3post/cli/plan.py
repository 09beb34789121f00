"""`k3post plan RECIPE [overrides] --gpus-per-node N --gpu-memory GiB --nodes M`: size a run
before launching it (docs/sizing.md).

Reads the recipe as `k3post run` does (overrides included), the models' configs only (no
weights), and prints what each actor group needs per device, where the actors land on the
described cluster and a verdict per device. Exit 0: everything fits; 1: something does not;
2: the recipe or the flags are wrong.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from k3post.config.errors import UserError

EXAMPLES = """examples:
  k3post plan examples/sizing/8b-two-32b-teachers.yaml --nodes 2 --gpus-per-node 8 --gpu-memory 80
  k3post plan examples/sizing/1.5b-7b-teacher.yaml --gpus-per-node 8 --gpu-memory 80 optim.micro_batch_size=2
  k3post plan recipes/quickstart.yaml --gpus-per-node 0 --host-memory 16
"""


def add_plan(sub) -> None:
    plan = sub.add_parser(
        "plan", help="size a run: memory per device, placement and a verdict, from the model configs alone",
        description="Estimate what every actor group of a recipe (learner ranks, samplers, each teacher, reward "
                    "models) needs on each device - parameters, gradients, optimizer states, activations, the "
                    "reference, FP8 QAT, LoRA, KV caches, vLLM reservations - from the models' config.json alone (no "
                    "weights are read), lay the actors out on the cluster described by the flags (not this machine) "
                    "as the run's placement would, and say per device whether it fits and, if not, which recipe "
                    "change would make it fit. Exit 0: it fits; 1: it does not; 2: the recipe or flags are wrong.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("recipe", help="a training recipe (distill, sft or rl), e.g. recipes/quickstart.yaml")
    plan.add_argument("overrides", nargs="*", metavar="KEY.PATH=VALUE", help="dotted overrides, as for run")
    plan.add_argument("--nodes", type=int, default=1, help="nodes of the cluster (default 1)")
    plan.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8; 0: a CPU machine)")
    plan.add_argument("--gpu-memory", type=float, default=80.0, metavar="GiB",
                      help="memory of each GPU in GiB (default 80: an H100 80 GB; H200: 141)")
    plan.add_argument("--host-memory", type=float, default=None, metavar="GiB",
                      help="host memory per node in GiB, for actors on CPUs (default: not checked)")
    plan.add_argument("--in-process", action="store_true",
                      help="size `k3post run --in-process`: every engine in one process (and on one GPU)")
    plan.add_argument("--prompt-tokens", type=int, default=None, metavar="N",
                      help="prompt length to size for (default: the recipe's data.max_prompt_tokens, the longest "
                           "it admits)")


def check_flags(args: argparse.Namespace) -> None:
    problems = []
    if args.nodes < 1:
        problems.append(f"--nodes {args.nodes}: expected at least 1 node")
    if args.gpus_per_node < 0:
        problems.append(f"--gpus-per-node {args.gpus_per_node}: expected 0 (CPUs only) or more GPUs")
    if args.gpu_memory <= 0:
        problems.append(f"--gpu-memory {args.gpu_memory:g}: expected the memory of one GPU in GiB, e.g. 80")
    if args.host_memory is not None and args.host_memory <= 0:
        problems.append(f"--host-memory {args.host_memory:g}: expected the host memory of a node in GiB, e.g. 16")
    if args.prompt_tokens is not None and args.prompt_tokens < 1:
        problems.append(f"--prompt-tokens {args.prompt_tokens}: expected a positive number of tokens")
    if problems:
        raise UserError("; ".join(problems))


def cmd_plan(args: argparse.Namespace) -> int:
    check_flags(args)
    from k3post.config.load import load_run_recipe  # noqa: PLC0415
    from k3post.plan.memory import GIB  # noqa: PLC0415
    from k3post.plan.placement import Cluster  # noqa: PLC0415
    from k3post.plan.report import make_plan, render  # noqa: PLC0415

    recipe = load_run_recipe(Path(args.recipe), args.overrides)
    cluster = Cluster(args.nodes, args.gpus_per_node, args.gpu_memory * GIB)
    host = args.host_memory * GIB if args.host_memory is not None else None
    plan = make_plan(recipe, cluster, args.prompt_tokens, host, in_process=args.in_process)
    print("\n".join(render(plan, args.recipe)))
    return 0 if plan.fits else 1
