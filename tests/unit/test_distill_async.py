"""The asynchronous OPD loop (train.mode: async) in process on tiny models: it runs the same
outputs as the synchronous loop, its rollouts are never more than one update stale, it resumes,
and it still learns."""

from __future__ import annotations

from pathlib import Path

import pytest

from k3post.cli.run import run_recipe
from k3post.track.metrics import read_metrics

SMOKE = Path(__file__).resolve().parents[2] / "recipes" / "smoke" / "tiny.yaml"


def run(run_dir: Path, *overrides: str) -> list[dict]:
    assert run_recipe(SMOKE, ["train.mode=async", *overrides], run_dir, in_process=True, restart=False) == 0
    return read_metrics(run_dir / "metrics.jsonl")


def test_async_run_logs_every_step_with_staleness_at_most_one(tmp_path):
    metrics = run(tmp_path / "a", "train.steps=4", "train.eval_every=2")
    assert [m["step"] for m in metrics] == [0, 1, 2, 3, 4]
    staleness = [m["async/staleness"] for m in metrics[1:]]
    assert staleness[0] == 0 and all(s <= 1 for s in staleness) and 1 in staleness
    for key in ("distill/kl/alpha", "train/loss", "time/sample_s", "time/sample_wait_s", "time/train_s",
                "throughput/tokens_per_s", "train/ratio_mean"):
        assert key in metrics[3], key
    assert "eval/kl/alpha" in metrics[2] and "eval/kl/alpha" in metrics[4]


def test_async_resume_goes_on_from_the_checkpoint(tmp_path, monkeypatch):
    import k3post.loops.distill_async as loop

    args = ("train.steps=4", "train.eval_every=0", "train.checkpoint_every=2")
    real_step = loop.async_step

    def crash_at_step_3(run_, pipeline, step):
        if step == 3:
            raise RuntimeError("injected crash")
        return real_step(run_, pipeline, step)

    monkeypatch.setattr(loop, "async_step", crash_at_step_3)
    with pytest.raises(RuntimeError, match="injected crash"):
        run(tmp_path / "b", *args)
    monkeypatch.setattr(loop, "async_step", real_step)
    resumed = run(tmp_path / "b", *args)
    assert [m["step"] for m in resumed] == [0, 1, 2, 3, 4]
    assert resumed[3]["async/staleness"] == 0  # fresh weights after a resume


def test_async_opd_lowers_the_exact_kl(tmp_path):
    """A reduced version of test_distill_loop's learning check (16 steps instead of 32)."""
    metrics = run(tmp_path / "d", "train.steps=16", "train.eval_every=16", "loss.kind=full_vocab", "optim.lr=0.01",
                  "teachers.alpha.model.tiny.init_std=0.2", "teachers.beta.model.tiny.init_std=0.2",
                  "data.prompts_per_step=8", "sampling.max_new_tokens=12", "eval.max_new_tokens=12",
                  "eval.prompts_per_source=4")
    first, last = metrics[0], metrics[-1]
    for teacher in ("alpha", "beta"):
        assert last[f"eval/kl/{teacher}"] < 0.9 * first[f"eval/kl/{teacher}"], teacher
        assert last[f"eval/fkl/{teacher}"] < first[f"eval/fkl/{teacher}"], teacher
