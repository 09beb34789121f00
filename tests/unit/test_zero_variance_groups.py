"""Groups with equal rewards: the share (pure maths), its progress field and the one-line warning."""

from __future__ import annotations

import pytest
import torch

from k3post.algo.advantages import zero_variance_share
from k3post.loops.rl import ZeroSignalWarning, no_signal_message
from k3post.track.progress import format_metrics


def test_share_of_groups_with_equal_rewards_by_hand():
    rewards_PG = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.2]])
    assert zero_variance_share(rewards_PG) == pytest.approx(0.5)  # rows 0 and 2
    assert zero_variance_share(torch.ones(3, 1)) == 1.0  # one sample per group: nothing to compare
    assert zero_variance_share(torch.empty(0, 4)) == 0.0


def test_share_refuses_a_flat_batch():
    with pytest.raises(ValueError, match=r"\[groups, group_size\]"):
        zero_variance_share(torch.ones(8))


def test_progress_line_shows_the_share_next_to_the_reward():
    line = format_metrics({"rl/reward/total": 1.0, "rl/pass_rate": 1.0, "rl/zero_variance_groups": 0.75,
                           "train/loss": 0.0})
    assert line == "reward=1.000 pass=1.00 zero_var=75% | loss=0"


def test_warning_once_per_streak_of_mostly_flat_steps():
    said = []
    warning = ZeroSignalWarning(said.append)
    for share in (1.0, 0.75, 1.0):  # one streak: one line
        warning.check(share, group_size=4)
    assert said == [no_signal_message(1.0, 4)]
    assert said[0].startswith("no learning signal: all 4 samples of each group got the same reward")
    warning.check(0.5, group_size=4)  # exactly half is not "most": the streak ends, no line
    warning.check(0.9, group_size=4)  # a new streak warns again
    assert len(said) == 2 and "90% of groups" in said[1]
