"""On a real Ray cluster (`k3post run` joining the shared head of conftest.py): two teachers with
different losses (top-k reverse KL, full-vocab reverse KL from [B, T, V] distributions), whose
payloads go teacher actor → learner actor by reference. The driver receives O(B·T) bytes a step,
and both teachers' held-out KL falls."""

from __future__ import annotations

import subprocess

import pytest

from k3post.track.metrics import read_metrics
from tests.integration.helpers import BIN, REPO, SMOKE

pytestmark = pytest.mark.integration

ROWS, MAX_T = 8, 12


def test_two_teachers_two_losses_on_ray_driver_bytes_stay_o_bt_and_both_kls_fall(shared_head, tmp_path):
    run_dir = tmp_path / "run"
    overrides = ["teachers.alpha.loss.kind=topk_reverse", "teachers.alpha.loss.k=16",
                 "teachers.beta.loss.kind=full_vocab", "train.steps=32", "train.eval_every=32",
                 "train.checkpoint_every=0", "optim.lr=0.01", "teachers.alpha.model.tiny.init_std=0.2",
                 "teachers.beta.model.tiny.init_std=0.2", f"data.prompts_per_step={ROWS}",
                 f"sampling.max_new_tokens={MAX_T}", f"eval.max_new_tokens={MAX_T}", "eval.prompts_per_source=4"]
    result = subprocess.run([str(BIN / "k3post"), "run", SMOKE, *overrides, "--run-dir", str(run_dir)], cwd=REPO,
                            env=shared_head.join_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"joined the Ray cluster at {shared_head.address}" in result.stdout
    metrics = read_metrics(run_dir / "metrics.jsonl")
    for m in metrics[1:]:
        # rollouts (ids 8 B, mask 4 B, log μ 4 B) + teacher log π_T (4 B) per token: 20 B; 32 allows slack.
        # A [B, T, V] teacher answer through the driver would add 404 B per beta token (V = 101).
        assert m["io/driver_bytes"] <= 32 * ROWS * MAX_T, m["step"]
    # ... while the learner got the full-vocab teacher's [B, T, V] rows (and alpha's top-k) by reference.
    assert sum(m["io/learner_teacher_bytes"] for m in metrics[1:]) > 10 * sum(m["io/driver_bytes"] for m in metrics[1:])
    first, last = metrics[0], metrics[-1]
    for teacher in ("alpha", "beta"):
        assert first[f"eval/kl/{teacher}"] > 0.3
        assert last[f"eval/kl/{teacher}"] < 0.8 * first[f"eval/kl/{teacher}"], teacher
        assert last[f"eval/fkl/{teacher}"] < first[f"eval/fkl/{teacher}"], teacher
