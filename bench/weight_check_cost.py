"""What the weight-sync check (engine/weight_check.py) costs per sync, against the sync itself.

In one process on the CPU: the quickstart's student (a 24-layer SmolLM2-135M) as a learner and
an HF sampler; each sync is `DirectWeightSync.push` split into its two parts, the copy
(`load_weights(learner.weights())`) and the check (learner and sampler checksums of the version's
window, compared). Every version of one full rotation of the window is timed, so each tensor
(the 28M-element embedding included) is checked once.

    .venv/bin/python bench/weight_check_cost.py [--recipe recipes/quickstart.yaml]
"""

from __future__ import annotations

import argparse
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch  # noqa: PLC0415

    from k3post.algo.objectives import SampledTokenPG  # noqa: PLC0415
    from k3post.config.load import load_distill_recipe  # noqa: PLC0415
    from k3post.engine.learner import Learner  # noqa: PLC0415
    from k3post.engine.sampler import HFSampler  # noqa: PLC0415
    from k3post.engine.weight_check import check_replicas, syncs_to_cover  # noqa: PLC0415
    from k3post.launch.engines import learner_config  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    recipe = load_distill_recipe(args.recipe)
    learner = Learner(learner_config(recipe, SampledTokenPG()))
    sampler = HFSampler(recipe.student, num_threads=args.threads)
    names = list(learner.weights())
    copies, checks = [], []
    for version in range(1, syncs_to_cover(len(names)) + 1):
        started = time.perf_counter()
        sampler.load_weights(learner.weights(), version)
        copied = time.perf_counter()
        expected = learner.weight_checksums(version)
        check_replicas(expected, [sampler.weight_checksums(list(expected))], version)
        checks.append(time.perf_counter() - copied)
        copies.append(copied - started)
    numel = sum(torch.as_tensor(v).numel() for v in learner.weights().values())
    print(f"{len(names)} tensors, {numel / 1e6:.1f}M parameters; {len(copies)} syncs (one rotation), "
          f"{args.threads} threads")
    print("| part | median s | max s | total s |")
    print("|---|---|---|---|")
    for label, values in (("copy (load_weights)", copies), ("check (both sides)", checks)):
        print(f"| {label} | {statistics.median(values):.4f} | {max(values):.4f} | {sum(values):.3f} |")
    print(f"check / (copy + check), over the rotation: {sum(checks) / (sum(copies) + sum(checks)):.1%}")


if __name__ == "__main__":
    main()
