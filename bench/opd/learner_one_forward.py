"""The learner step alone, before/after the one-forward change (one decoder forward instead of two).

Quickstart student (recipes/bench/speed-chat.yaml), a synthetic batch of 8 rows (40-54 prompt
tokens + 48 completion tokens), full-vocabulary reverse KL against random teacher distributions;
one warm-up step, then 3 rounds of (after, before) in alternating order; median wall and CPU s.

    .venv/bin/python bench/opd/learner_one_forward.py
    .venv/bin/python bench/opd/learner_one_forward.py --label "AVX2-only machine"   # a run told apart by its label

The medians and the after/before ratios are appended to bench/results/learner-one-forward.jsonl
(`results.record`); `--no-record` leaves the file alone (a trial run).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: k3post, bench.*
from bench.results import add_no_record, record_and_say, rounded  # noqa: E402

SECTION = "OPD step against TRL GKDTrainer, same CPU, models and batch (`bench/opd/opd_vs_trl_step.py`)"
NAMES = {"before": "two decoder forwards (before)", "after": "one decoder forward (after)"}


def result_rows(medians: dict[str, tuple[float, float]], label: str | None = None) -> list[dict]:
    """Rows of a run: each variant's median wall and CPU seconds (2 decimals, as printed), and
    after / before of both when the run has the two. `medians`: variant -> (wall s, CPU s)."""
    head = "learner step, quickstart student, 8 rows, full-vocabulary reverse KL" + (f", {label}" if label else "")
    rows = []
    for variant, (wall, cpu) in medians.items():
        rows += [{"metric": f"{head}: {NAMES[variant]}, wall time", "value": rounded(wall, 2), "unit": "s"},
                 {"metric": f"{head}: {NAMES[variant]}, CPU time", "value": rounded(cpu, 2), "unit": "s"}]
    if {"before", "after"} <= set(medians):
        (wall_a, cpu_a), (wall_b, cpu_b) = medians["after"], medians["before"]
        rows += [{"metric": f"{head}: after / before, wall time", "value": rounded(wall_a / wall_b, 2), "unit": "×",
                  "ratio_to": "two decoder forwards"},
                 {"metric": f"{head}: after / before, CPU time", "value": rounded(cpu_a / cpu_b, 2), "unit": "×",
                  "ratio_to": "two decoder forwards"}]
    return rows


def measure(rounds: int = 3) -> dict[str, list[tuple[float, float]]]:
    import torch  # noqa: PLC0415

    from k3post.algo.objectives import FullVocabReverseKL  # noqa: PLC0415
    from k3post.config.load import load_distill_recipe  # noqa: PLC0415
    from k3post.engine.learner.learner import Learner, LearnerConfig  # noqa: PLC0415
    from k3post.types import TrainBatch  # noqa: PLC0415
    from bench.opd.opd_vs_trl_step import two_forward_learner  # noqa: PLC0415

    r = load_distill_recipe("recipes/bench/speed-chat.yaml")
    lrn = Learner(LearnerConfig(student=r.student, optim=r.optim, total_steps=10, objective=FullVocabReverseKL()))
    V = lrn.model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(0)
    B, T = 8, 48
    prompts = [torch.randint(100, 5000, (40 + 2 * i,), generator=g).tolist() for i in range(B)]
    batch = TrainBatch(prompts, torch.randint(100, 5000, (B, T), generator=g), torch.ones(B, T),
                       torch.zeros(B, T) - 2, torch.zeros(B, T), torch.log_softmax(torch.randn(B, T, V, generator=g), -1))
    lrn.train_step(batch)
    res = {"after": [], "before": []}
    for rep in range(rounds):
        for name in ("before", "after") if rep % 2 else ("after", "before"):
            with two_forward_learner() if name == "before" else contextlib.nullcontext():
                w, c = time.perf_counter(), time.process_time()
                lrn.train_step(batch)
                res[name].append((time.perf_counter() - w, time.process_time() - c))
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", help="names this run apart from other runs of the command (in its rows)")
    add_no_record(parser)
    args = parser.parse_args()
    res = measure(args.rounds)
    medians = {}
    for k, v in res.items():
        medians[k] = (statistics.median(a for a, _ in v), statistics.median(b for _, b in v))
        print(k, "wall", [round(a, 2) for a, _ in v], "median", round(medians[k][0], 2),
              "cpu median", round(medians[k][1], 2), flush=True)
    record_and_say("learner-one-forward", result_rows(medians, args.label), args.no_record, source_section=SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
