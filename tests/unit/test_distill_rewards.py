"""OPD mixed with task rewards (A_t = A_OPD + coef · reward advantage), in-process on tiny models."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from k3post.cli.run import run_recipe
from k3post.track.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny.yaml"
ARGS = ["sampling.n=2", "train.eval_every=0"]


def recipe_with_rewards(tmp_path: Path) -> Path:
    recipe = yaml.safe_load(SMOKE.read_text())
    for name in recipe["teachers"]:
        recipe["teachers"][name] = str((SMOKE.parent / recipe["teachers"][name]).resolve())
    # Only the math source names a reward; chat rows are pure OPD.
    (tmp_path / "digits.py").write_text(
        "def share(prompt, completion, meta):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n")
    recipe["data"]["sources"][1]["rewards"] = [{"fn": f"{tmp_path / 'digits.py'}:share", "weight": 1.0}]
    path = tmp_path / "opd-rewards.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def run(recipe: Path, run_dir: Path, *overrides: str) -> list[dict]:
    assert run_recipe(recipe, [*ARGS, *overrides], run_dir, in_process=True, restart=False) == 0
    return read_metrics(run_dir / "metrics.jsonl")


def test_rewards_with_coef_0_are_plain_opd_and_with_coef_1_change_the_update(tmp_path):
    mixed = recipe_with_rewards(tmp_path)
    plain = run(SMOKE, tmp_path / "plain")
    zero = run(mixed, tmp_path / "zero", "loss.reward_coef=0")
    one = run(mixed, tmp_path / "one", "loss.reward_coef=1")
    for a, b, c in zip(plain[1:], zero[1:], one[1:]):
        for key in ("train/loss", "train/grad_norm"):  # same samples, same update
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9)
        # The reward advantages are zero-mean within each group, so at θ = θ_old (ratio 1) they
        # barely move the loss *value*; the gradient is what they change.
        assert c["train/grad_norm"] != pytest.approx(a["train/grad_norm"], rel=1e-3)
        assert "rl/reward/share" not in a
        for m in (b, c):
            assert {"rl/reward/share", "rl/reward/total", "rl/pass_rate", "rl/source/math/reward",
                    "distill/kl/alpha", "distill/kl/beta", "time/reward_s"} <= set(m)
            assert "rl/source/chat/reward" not in m  # chat names no rewards: not scored
            assert 0.0 <= m["rl/reward/share"] <= 1.0
