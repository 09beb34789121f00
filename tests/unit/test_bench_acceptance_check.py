"""bench/sampling/acceptance_check.py: the K = 1 rounds a row's position acceptances predict, against
brute force over every accept/reject path, closed forms, and a Monte Carlo run of the rounds."""

import itertools
import random

import pytest

from bench.sampling.acceptance_check import expected_rounds, predicted_length


def brute_force_rounds(accept: list[float]) -> float:
    """E[rounds] summed over every sequence of coins: a round at k (tokens 0..k emitted) draws the
    draft of token k + 1 and moves to k + 2 if accepted, else k + 1; the row ends at n − 1."""
    n, total = len(accept) + 1, 0.0
    for coins in itertools.product((True, False), repeat=n):  # more coins than any path uses
        k, rounds, weight = 0, 0, 1.0
        for accepted in coins:
            if k >= n - 1:
                break
            weight *= accept[k] if accepted else 1.0 - accept[k]
            k, rounds = k + (2 if accepted else 1), rounds + 1
        total += weight * rounds / 2 ** (n - rounds)  # the unused coins' 2^(n - rounds) copies of this path
    return total


@pytest.mark.parametrize("seed", range(5))
def test_rounds_equal_the_enumerated_paths(seed):
    rng = random.Random(seed)
    accept = [rng.random() for _ in range(rng.randint(1, 9))]
    assert expected_rounds(accept) == pytest.approx(brute_force_rounds(accept), abs=1e-12)


def test_closed_forms():
    assert expected_rounds([]) == 0.0  # one token: the prefill's, no round
    assert expected_rounds([0.0] * 9) == 9.0  # nothing accepted: a round a token
    assert expected_rounds([1.0] * 9) == 5.0  # every draft accepted: two tokens a round, the last round one
    # a constant a: the length tends to 1 + a; stretches of a = 1 and a = 0 have the same mean a = 0.5
    # but take a round for two tokens in the first and for one in the second: 4/3
    assert predicted_length([[0.5] * 20000]) == pytest.approx(1.5, abs=1e-3)
    assert predicted_length([([1.0] * 100 + [0.0] * 100) * 50]) == pytest.approx(4 / 3, abs=1e-3)


def test_matches_a_simulation_of_the_rounds():
    rng = random.Random(0)
    accept = [rng.choice((0.05, 0.9)) for _ in range(60)]
    runs, rounds = 20000, 0
    for _ in range(runs):
        k = 0
        while k < len(accept):
            k, rounds = k + (2 if rng.random() < accept[k] else 1), rounds + 1
    assert rounds / runs == pytest.approx(expected_rounds(accept), rel=0.01)


def test_the_check_is_recorded_with_each_engine_and_k(tmp_path):
    """bench/sampling/speculation_gpu.py --check-acceptance --results DIR records the prediction (with
    α in its notes) and every realised length under its engine and K."""
    import json
    from argparse import Namespace

    from bench.sampling import speculation_gpu

    found = {"alpha": 0.5, "predicted": 1.42, (1, "eager"): 1.41, (1, "compiled"): 1.40, (2, "compiled"): 1.55}
    speculation_gpu.save_check(found, 8, Namespace(results=tmp_path, commit="abc1234", set=[], new_tokens=256,
                                                   device="cuda"))
    rows = {r["metric"]: r for r in map(json.loads, (tmp_path / "speculation-gpu.jsonl").read_text().splitlines())}
    predicted = rows["acceptance length predicted from each position's teacher-forced acceptance, K = 1, batch 8, "
                     "256 new tokens"]
    assert predicted["value"] == 1.42 and "α 0.500" in predicted["notes"] and "1 + α = 1.500" in predicted["notes"]
    realised = "acceptance length realised by the {} static engine, K = {}, batch 8, 256 new tokens"
    assert rows[realised.format("eager", 1)]["value"] == 1.41
    assert rows[realised.format("compiled", 1)]["value"] == 1.40
    assert rows[realised.format("compiled", 2)]["value"] == 1.55
    assert len(rows) == 4


def test_a_cpu_check_says_so_in_its_rows(tmp_path):
    import json
    from argparse import Namespace

    from bench.sampling import speculation_gpu

    found = {"alpha": 0.5, "predicted": 1.42, (1, "eager"): 1.41}
    speculation_gpu.save_check(found, 8, Namespace(results=tmp_path, commit="abc1234", set=[], new_tokens=256,
                                                   device="cpu"))
    metrics = [json.loads(line)["metric"] for line in (tmp_path / "speculation-gpu.jsonl").read_text().splitlines()]
    assert metrics == ["acceptance length predicted from each position's teacher-forced acceptance, K = 1, batch 8, "
                       "256 new tokens, fp32 on a CPU",
                       "acceptance length realised by the eager static engine, K = 1, batch 8, 256 new tokens, fp32 "
                       "on a CPU"]
