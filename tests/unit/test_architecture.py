"""The import graph is the architecture: layer contracts hold, and the layers below `dist`
import without Ray or vLLM present."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('ray', 'vllm'):
            raise ImportError(f'blocked import of {name}')
sys.meta_path.insert(0, Block())
import k3post, k3post.types, k3post.config.load, k3post.algo.opd, k3post.algo.policy_loss
import k3post.algo.aggregate, k3post.algo.schedule, k3post.model.load, k3post.model.logprobs
import k3post.model.sampling, k3post.data.mixture, k3post.data.sources, k3post.track.metrics
import k3post.engine.learner, k3post.engine.sampler, k3post.engine.teacher, k3post.loops.distill
import k3post.dist.local, k3post.dist.launch, k3post.rewards.loader, k3post.rewards.pool
import k3post.rewards.sandbox, k3post.algo.rl, k3post.algo.kl, k3post.loops.sft, k3post.model.fp8_export
print('ok')
"""


def test_layers_below_dist_import_without_ray_or_vllm():
    result = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_the_blocker_really_blocks():
    code = BLOCKER.replace("print('ok')", "import k3post.dist.ray_groups")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode != 0 and "blocked import of ray" in result.stderr


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "broken" not in result.stdout.split("Contracts:")[-1].replace("0 broken", "")
