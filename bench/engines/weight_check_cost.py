"""What the weight-sync check (engine/transport/weight_check.py) costs per sync, against the sync itself.

In one process on the CPU: the quickstart's student (a 24-layer SmolLM2-135M) as a learner and
an HF sampler; each sync is `DirectWeightSync.push` split into its two parts, the copy
(`load_weights(learner.weights())`) and the check (learner and sampler checksums of the version's
window, compared). Every version of one full rotation of the window is timed, so each tensor
(the 28M-element embedding included) is checked once.

    .venv/bin/python bench/engines/weight_check_cost.py [--recipe recipes/quickstart.yaml] [--label "run 1"] \
        [--no-record]

At the end the medians per sync of the copy and the check, and the check's share of the median
sync and of the whole rotation, are appended to bench/results/weight-check-cost.jsonl
(`results.record`, named "CPU, in process, <--label>: ..."; the machine's load average before
and after goes into the notes); `--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "The weight-sync check's cost per sync (`bench/engines/weight_check_cost.py`)"


def result_rows(copies: list[float], checks: list[float], label: str) -> list[dict]:
    """bench/results rows: the copy's and the check's median seconds per sync (3 decimals) and the
    check's share (%, 1 decimal) of the median sync and of the whole rotation's time."""
    copy, check = statistics.median(copies), statistics.median(checks)
    head = f"CPU, in process, {label}"
    return [{"metric": f"{head}: copy, median per sync", "value": rounded(copy, 3), "unit": "s"},
            {"metric": f"{head}: check, median per sync", "value": rounded(check, 3), "unit": "s"},
            {"metric": f"{head}: check's share of the median sync", "value": rounded(100 * check / (copy + check), 1),
             "unit": "%"},
            {"metric": f"{head}: check's share of the whole rotation",
             "value": rounded(100 * sum(checks) / (sum(copies) + sum(checks)), 1), "unit": "%"}]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipe", default="recipes/quickstart.yaml")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--label", default="run 1", help="the recorded metrics' run label")
    add_no_record(parser)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]

    import torch  # noqa: PLC0415

    from k3post.algo.objectives import SampledTokenPG  # noqa: PLC0415
    from k3post.config.load import load_distill_recipe  # noqa: PLC0415
    from k3post.engine.learner.learner import Learner  # noqa: PLC0415
    from k3post.engine.samplers.sampler import HFSampler  # noqa: PLC0415
    from k3post.engine.transport.weight_check import check_replicas, syncs_to_cover  # noqa: PLC0415
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
    loads = sorted((load_before, os.getloadavg()[0]))
    notes = (f"load {loads[0]:.1f}–{loads[1]:.1f}; {len(names)} tensors, {numel / 1e6:.1f}M parameters, "
             f"{len(copies)} syncs (one rotation), {args.threads} threads; {args.recipe}")
    rows = [{**r, "notes": notes} for r in result_rows(copies, checks, args.label)]
    record_and_say("weight-check-cost", rows, args.no_record, source_section=SECTION)


if __name__ == "__main__":
    main()
