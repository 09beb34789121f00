"""The warmup-cosine multiplier at hand-computed points."""

from __future__ import annotations

import math

import pytest

from k3post.algo.schedule import warmup_cosine_factor

W, S, R = 10, 110, 0.1  # warmup 10 steps, 100 steps of cosine, floor 0.1


def factor(step: int) -> float:
    return warmup_cosine_factor(step, warmup_steps=W, total_steps=S, min_ratio=R)


def test_warmup_is_linear_from_one_over_w_to_one():
    assert factor(0) == pytest.approx(1 / 10)
    assert factor(4) == pytest.approx(5 / 10)
    assert factor(9) == pytest.approx(1.0)  # last warmup step reaches 1
    assert factor(10) == pytest.approx(1.0)  # cosine starts at 1: continuous


def test_cosine_points_and_floor():
    assert factor(60) == pytest.approx((1 + R) / 2)  # halfway through the cosine
    assert factor(35) == pytest.approx(R + (1 - R) * 0.5 * (1 + math.cos(math.pi / 4)))  # a quarter in
    assert factor(109) == pytest.approx(R + (1 - R) * 0.5 * (1 + math.cos(math.pi * 99 / 100)))
    assert factor(110) == pytest.approx(R)  # end of the schedule
    assert factor(111) == factor(10_000) == R  # constant after


def test_monotone_after_warmup():
    values = [factor(step) for step in range(W, S + 5)]
    assert all(later <= earlier for earlier, later in zip(values, values[1:]))
    assert values[-1] == R < values[0]


def test_no_warmup_and_zero_length_decay():
    assert warmup_cosine_factor(0, warmup_steps=0, total_steps=4, min_ratio=0.0) == 1.0
    assert warmup_cosine_factor(2, warmup_steps=0, total_steps=4, min_ratio=0.0) == pytest.approx(0.5)
    assert warmup_cosine_factor(1, warmup_steps=2, total_steps=2, min_ratio=0.2) == 1.0
    assert warmup_cosine_factor(2, warmup_steps=2, total_steps=2, min_ratio=0.2) == 0.2


@pytest.mark.parametrize(
    "step, warmup, total, ratio", [(-1, 0, 10, 0.0), (0, -1, 10, 0.0), (0, 5, 4, 0.0), (0, 0, 10, 1.5)]
)
def test_invalid_arguments_raise(step: int, warmup: int, total: int, ratio: float):
    with pytest.raises(ValueError):
        warmup_cosine_factor(step, warmup, total, ratio)
