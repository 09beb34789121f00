"""SFT (with FP8 QAT) and RL on 2 gloo learner ranks on a real local Ray cluster equal the
one-process learner run in process: every step's loss and gradient norm, and the final weights
(the checkpoint's Hugging Face export, gathered from the shards). OPD is compared the same way in
test_ray_learner_ranks.py; the maths of all three is compared rank by rank in
tests/unit/test_sharded_learner.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

from k3post.cli.run import run_recipe
from k3post.track.metrics import read_metrics
from tests.integration.helpers import BIN, REPO, env_without_ray_address

pytestmark = pytest.mark.integration
STEPS = 3
COMMON = [f"train.steps={STEPS}", "train.eval_every=0", f"train.checkpoint_every={STEPS}"]


def train_metrics(run_dir: Path) -> list[dict]:
    rows = [m for m in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in m]
    assert [m["step"] for m in rows] == list(range(1, STEPS + 1)), rows
    return rows


def run_both(tmp_path: Path, recipe: str) -> tuple[Path, Path]:
    """The recipe in process (one learner process), and as `k3post run` on local Ray with 2 ranks."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert run_recipe(REPO / recipe, COMMON, one, in_process=True, restart=False) == 0
    ray_run = subprocess.run([str(BIN / "k3post"), "run", recipe, *COMMON, "resources.learner.replicas=2",
                              "--run-dir", str(two)], cwd=REPO, env=env_without_ray_address(),
                             capture_output=True, text=True, timeout=600)
    assert ray_run.returncode == 0, ray_run.stdout[-3000:] + ray_run.stderr[-3000:]
    return one, two


# Opt-in (K3POST_SLOW=1, 75 s): the same equality runs in make test on 2 spawned gloo ranks
# (tests/unit/test_sharded_learner.py), and the Ray layer of the rank group in test_ray_learner_ranks.py.
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["recipes/smoke/tiny-sft-qat.yaml", "recipes/smoke/tiny-rl.yaml"])
def test_two_ray_ranks_train_exactly_as_one_process(tmp_path, recipe):
    one, two = run_both(tmp_path, recipe)
    for want, got in zip(train_metrics(one), train_metrics(two)):
        for key in ("train/loss", "train/grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (want["step"], key)
    final = f"checkpoints/step-{STEPS}/model.safetensors"
    want_weights, got_weights = load_file(one / final), load_file(two / final)
    assert want_weights.keys() == got_weights.keys()
    for name, tensor in want_weights.items():
        assert (got_weights[name] - tensor).abs().max().item() <= 1e-5, name
