"""The closing lines of `k3post run`: the first and the last held-out evaluation, per kind."""

from __future__ import annotations

from types import SimpleNamespace

from k3post.track.summary import distill_summary, rl_summary, sft_summary

HISTORY = [{"step": 0, "eval/nll": 2.0, "eval/reward/total": 0.1, "eval/pass_rate": 0.0, "eval/kl/a": 0.8,
            "eval/fkl/a": 1.0},
           {"step": 3, "train/loss": 1.0},  # no evaluation: skipped
           {"step": 5, "eval/nll": 1.5, "eval/reward/total": 0.5, "eval/pass_rate": 0.25, "eval/kl/a": 0.4,
            "eval/fkl/a": 0.9}]


def test_each_kind_reports_its_first_and_last_evaluation():
    assert sft_summary(HISTORY, None) == ["held-out NLL, step 0 → step 5: 2.0000 → 1.5000 (-25%)"]
    assert rl_summary(HISTORY, None) == ["held-out reward, step 0 → step 5: 0.100 → 0.500; pass rate 0.00 → 0.25"]
    lines = distill_summary(HISTORY, SimpleNamespace(teachers={"a": None}))
    assert lines[0] == "held-out KL, step 0 → step 5:"
    assert "0.800 → 0.400 (-50%)" in lines[1] and "1.000 → 0.900 (-10%)" in lines[2]


def test_one_evaluation_is_no_summary():
    assert sft_summary(HISTORY[:2], None) == rl_summary(HISTORY[:1], None) == []
