"""On a real Ray head with token authentication: a 2-step GRPO run submitted as a job, with a rule
reward in the driver's worker pool and a reward model in its own actor group."""

from __future__ import annotations

import json
import subprocess

import pytest

from k3post.config.schema import RewardModelSpec, TinyModelSpec
from k3post.engine.evaluation.reward_model import RewardModelScorer
from k3post.model.loading.classifier import save_tiny_classifier
from k3post.track.metrics import read_metrics
from k3post.types import Prompt
from rewards.length import penalty
from tests.integration.helpers import BIN, REPO, upload_excludes

pytestmark = pytest.mark.integration
RL_SMOKE = "recipes/smoke/tiny-rl.yaml"


def test_grpo_job_with_a_rule_reward_and_a_reward_model_actor(ray_head, tmp_path):
    env, address = ray_head
    classifier = save_tiny_classifier(TinyModelSpec(hidden_size=32, num_layers=2, seed=7), tmp_path / "rm")
    run_dir = tmp_path / "rl-run"
    submit = [str(BIN / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
              "--runtime-env-json", json.dumps({"excludes": upload_excludes()}), "--",
              str(BIN / "k3post"), "run", RL_SMOKE, "--run-dir", str(run_dir),
              "reward_models.judge.tiny=null", f"reward_models.judge.path={classifier}"]
    result = subprocess.run(submit, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "joined the Ray cluster" in result.stdout
    assert "reward models: judge" in result.stdout  # the reward model ran as its own actor group

    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    for step in metrics[1:]:
        assert {"rl/reward/penalty", "rl/reward/judge", "rl/reward/total", "rl/pass_rate", "rl/response_len",
                "train/loss"} <= set(step)
        assert step["rl/reward/failures"] == 0
    assert (run_dir / "checkpoints" / "step-2" / "COMPLETE").is_file()

    # The held-out rewards the job logged are the rule reward plus 0.5 × the classifier's score,
    # recomputed here from the saved samples with the same classifier directory.
    judge = RewardModelScorer("judge", RewardModelSpec(path=str(classifier)))
    rows = [json.loads(line) for line in (run_dir / "samples" / "step-0.jsonl").read_text().splitlines()]
    prompts = [Prompt(f"x/{i}", "math", "", (("user", r["prompt"]),)) for i, r in enumerate(rows)]
    scores = judge.score(prompts, [r["student"] for r in rows])
    for row, score in zip(rows, scores):
        rule = penalty(row["prompt"], row["student"], {}, target=4, window=8)
        assert row["reward"] == pytest.approx(rule + 0.5 * score, abs=1e-4)
