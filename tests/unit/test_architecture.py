"""The import graph is the architecture: layer contracts hold, and every module outside the Ray
layer (k3post/ray) imports without Ray or vLLM present."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BLOCK = """
import importlib, pkgutil, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('ray', 'vllm'):
            raise ImportError(f'blocked import of {name}')
sys.meta_path.insert(0, Block())
"""
BLOCKER = BLOCK + """
import k3post
names = sorted(m.name for m in pkgutil.walk_packages(k3post.__path__, 'k3post.')
               if not (m.name == 'k3post.ray' or m.name.startswith('k3post.ray.')))
for name in names:
    importlib.import_module(name)
print(len(names), 'modules ok')
"""


def test_every_module_outside_the_ray_layer_imports_without_ray_or_vllm():
    result = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    count = int(result.stdout.split()[-3])
    # the launch layer and the loops are among them (a walk that found nothing would prove nothing)
    assert count > 80, result.stdout


def test_the_blocker_really_blocks():
    result = subprocess.run([sys.executable, "-c", BLOCK + "import k3post.ray.groups"], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode != 0 and "blocked import of ray" in result.stderr


def test_import_linter_contracts_hold():
    lint = Path(sys.executable).parent / "lint-imports"
    result = subprocess.run([str(lint)], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "broken" not in result.stdout.split("Contracts:")[-1].replace("0 broken", "")
