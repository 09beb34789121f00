"""bench/sampling/speculation_profile.py's arithmetic over recorded GPU intervals, against
hand-computed unions."""

import pytest

from bench.sampling.speculation_profile import breakdown, busy_ns


@pytest.mark.parametrize(("intervals", "busy"), [
    ([], 0),
    ([("a", 0, 10)], 10),
    ([("a", 0, 10), ("b", 20, 25)], 15),  # a gap is not busy
    ([("a", 0, 10), ("b", 5, 12)], 12),  # overlapping streams count once
    ([("a", 0, 10), ("b", 2, 8), ("c", 9, 30)], 30),  # nested, then chained
    ([("c", 40, 50), ("a", 0, 10), ("b", 10, 20)], 30),  # unsorted, touching
])
def test_busy_is_the_union_of_the_intervals(intervals, busy):
    assert busy_ns(intervals) == busy


def test_breakdown_per_iteration_and_ranked():
    intervals = [("gemm", 0, 4000), ("gemm", 5000, 9000), ("softmax", 8500, 9500), ("copy", 20000, 22000)]
    found = breakdown(intervals, iterations=2, top=2)
    assert found["busy_us"] == pytest.approx((4000 + 4500 + 2000) / 1e3 / 2)  # idle 4000-5000 and 9500-20000
    assert found["kernel_us"] == pytest.approx((4000 + 4000 + 1000 + 2000) / 1e3 / 2)
    assert found["kernels"] == 2
    assert found["top"] == [("gemm", 4.0, 1.0), ("copy", 1.0, 0.5)]


def test_profiles_are_recorded_per_iteration_and_against_a_decode_step(tmp_path):
    """bench/sampling/speculation_gpu.py --profile --results DIR records each engine's busy time and a
    round's ratio to a decode step's."""
    import json
    from argparse import Namespace

    from bench.sampling import speculation_gpu

    found = {0: {"iteration_s": 1.2e-3, "profile": {"busy_us": 950.0, "kernel_us": 960.0, "kernels": 349}},
             2: {"iteration_s": 1.7e-3, "profile": {"busy_us": 1330.0, "kernel_us": 1340.0, "kernels": 405}}}
    speculation_gpu.save_profiles(found, 8, Namespace(results=tmp_path, commit="abc1234", set=[]))
    rows = {r["metric"]: r for r in map(json.loads, (tmp_path / "speculation-gpu.jsonl").read_text().splitlines())}
    assert rows["GPU busy time of a decode step, batch 8"]["value"] == 950.0
    assert rows["GPU busy time of a round, K = 2, batch 8"]["value"] == 1330.0
    assert "405 kernels" in rows["GPU busy time of a round, K = 2, batch 8"]["notes"]
    assert rows["GPU busy time of a round ÷ of a decode step, K = 2, batch 8"]["value"] == pytest.approx(1.4, abs=1e-3)
    assert {r["commit"] for r in rows.values()} == {"abc1234"}


def test_a_run_with_recipe_overrides_names_them_in_its_rows(tmp_path):
    """`--set sampling.temperature=0.5` measures another setting than the recipe's: its rows say so,
    and are never read as the recipe's."""
    import json
    from argparse import Namespace

    from bench.sampling import speculation_gpu

    found = {0: {"iteration_s": 1.2e-3, "tokens_per_s": 4000.0},
             2: {"iteration_s": 1.5e-3, "tokens_per_s": 6000.0, "speed_up": 1.5, "acceptance_length": 2.0,
                 "steps_per_round": 1.8,
                 "pays": True}}
    speculation_gpu.save_rate(found, 2, 8, Namespace(results=tmp_path, commit="abc1234",
                                                     set=["sampling.temperature=0.5"]))
    [row] = map(json.loads, (tmp_path / "speculation-gpu.jsonl").read_text().splitlines())
    assert row["metric"] == ("rollout tokens/s with the trained head ÷ without, K = 2, batch 8, with "
                             "sampling.temperature=0.5")
    assert row["value"] == 1.5 and "acceptance length 2.00; a round replaces 1.80 decode steps" in row["notes"]
