"""The RL loop in-process on tiny models: outputs, resume, failing rewards, and learning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from k3post.cli.run import run_recipe
from k3post.track.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "recipes" / "smoke" / "tiny-rl.yaml"

REWARDS = '''
import time

def share_of_digits(prompt, completion, meta):
    """The fraction of the completion's characters that are digits (a dense, learnable reward)."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)

def boom(prompt, completion, meta):
    raise RuntimeError("this reward always fails")

def slow(prompt, completion, meta):
    time.sleep(5)
    return 1.0

def with_details(prompt, completion, meta):
    return {"reward": 1.0, "tokens": float(meta["completion_tokens"]), "has_answer": float("answer" in meta)}
'''


def run(recipe: Path, run_dir: Path, *overrides: str) -> list[dict]:
    assert run_recipe(recipe, list(overrides), run_dir, in_process=True, restart=False) == 0
    return read_metrics(run_dir / "metrics.jsonl")


def write_recipe(tmp_path: Path, rewards: list[dict], **changes) -> Path:
    (tmp_path / "myrewards.py").write_text(REWARDS)
    recipe = yaml.safe_load(SMOKE.read_text())
    recipe["data"]["sources"][0]["rewards"] = [
        {**r, "fn": f"{tmp_path / 'myrewards.py'}:{r['fn']}"} if "fn" in r else r for r in rewards]
    recipe.update(changes)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def test_run_writes_every_promised_output(tmp_path):
    metrics = run(SMOKE, tmp_path / "r")
    assert [m["step"] for m in metrics] == [0, 1, 2]
    step = metrics[1]
    for key in ("rl/reward/penalty", "rl/reward/judge", "rl/reward/total", "rl/reward/failures", "rl/pass_rate",
                "rl/response_len", "rl/constant_groups", "rl/source/math/reward", "train/loss", "train/grad_norm",
                "train/ratio_mean", "time/sample_s", "time/reward_s", "time/train_s", "time/sync_s"):
        assert key in step, key
    # R = 1.0 · penalty + 0.5 · judge, averaged over the batch
    assert step["rl/reward/total"] == pytest.approx(step["rl/reward/penalty"] + 0.5 * step["rl/reward/judge"],
                                                    abs=1e-5)
    assert step["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # sampler and learner agree: on-policy
    for m in (metrics[0], metrics[2]):
        assert {"eval/reward/total", "eval/reward/judge", "eval/pass_rate", "eval/response_len"} <= set(m)
    samples = [json.loads(x) for x in (tmp_path / "r" / "samples" / "step-2.jsonl").read_text().splitlines()]
    assert len(samples) == 2 and {"prompt", "student", "reward"} <= set(samples[0])
    assert (tmp_path / "r" / "checkpoints" / "step-2" / "COMPLETE").is_file()


def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path, monkeypatch):
    args = ("train.steps=4", "train.eval_every=0", "train.checkpoint_every=2")
    straight = run(SMOKE, tmp_path / "a", *args)

    import k3post.loops.rl as loop

    real_step = loop.rl_step

    def crash_at_step_3(run_, step):
        if step == 3:
            raise RuntimeError("injected crash")
        return real_step(run_, step)

    monkeypatch.setattr(loop, "rl_step", crash_at_step_3)
    with pytest.raises(RuntimeError, match="injected crash"):
        run(SMOKE, tmp_path / "b", *args)
    monkeypatch.setattr(loop, "rl_step", real_step)
    resumed = run(SMOKE, tmp_path / "b", *args)
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]
    for a, b in zip(straight, resumed):
        for key in ("rl/reward/total", "rl/reward/judge", "train/loss", "train/lr", "eval/reward/total"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)


def test_failing_and_hanging_rewards_are_logged_failures_not_crashes(tmp_path):
    recipe = write_recipe(tmp_path, [{"fn": "boom", "weight": 1.0}, {"fn": "slow", "weight": 1.0},
                                     {"fn": "with_details", "weight": 2.0}],
                          scoring={"workers": 8, "timeout_s": 0.5, "pass_threshold": 2.0}, reward_models={})
    metrics = run(recipe, tmp_path / "f", "train.steps=1", "train.eval_every=0")
    step = metrics[1]
    rows = 2 * 4  # prompts_per_step × n
    assert step["rl/reward/failures"] == 2 * rows  # boom and slow, on every sample
    assert step["rl/reward/boom/error"] == 1.0 and step["rl/reward/slow/error"] == 1.0
    assert step["rl/reward/boom"] == 0.0 and step["rl/reward/slow"] == 0.0  # a failure scores 0
    assert step["rl/reward/total"] == pytest.approx(2.0)  # only with_details (weight 2) counts
    assert step["rl/pass_rate"] == 1.0
    # the dict's extra keys are diagnostics: meta carries the row's fields and the token count
    assert step["rl/reward/with_details/has_answer"] == 1.0
    assert step["rl/reward/with_details/tokens"] == pytest.approx(step["rl/response_len"])
    assert step["rl/zero_variance_groups"] == 1.0  # equal rewards: no signal, zero advantages
    assert step["train/loss"] == 0.0


@pytest.mark.parametrize("advantage, loss, aggregation", [("grpo", "ppo_clip", "token"),
                                                         ("rloo", "is", "sequence")])
def test_grpo_raises_a_dense_reward(tmp_path, advantage, loss, aggregation):
    """Learning, measured: 20 steps on a tiny random student raise the held-out reward
    'share of digits' well above the untrained model's."""
    recipe = write_recipe(tmp_path, [{"fn": "share_of_digits", "weight": 1.0}], reward_models={})
    metrics = run(recipe, tmp_path / "l", "train.steps=20", "train.eval_every=20", "optim.lr=0.01",
                  "data.prompts_per_step=4", "sampling.n=4", "sampling.max_new_tokens=12",
                  "eval.max_new_tokens=12", "eval.prompts_per_source=4", f"loss.advantage={advantage}",
                  f"loss.policy_loss={loss}", f"loss.aggregation={aggregation}")
    first, last = metrics[0]["eval/reward/total"], metrics[-1]["eval/reward/total"]
    print(advantage, loss, aggregation, "eval reward", first, "->", last,
          [round(m["rl/reward/total"], 3) for m in metrics[1:]])
    assert last > first + 0.2  # measured (grpo, ppo_clip, token): 0.11 → 0.36
    train_curve = [m["rl/reward/total"] for m in metrics[1:]]
    assert sum(train_curve[-5:]) > 2 * sum(train_curve[:5])
