"""atomic_directory and checkpoint listing/pruning, including a writer killed mid-checkpoint."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from k3post.track.atomic import (
    COMPLETE, atomic_directory, latest_checkpoint, list_checkpoints, mark_complete,
    prune_checkpoints, write_json_atomic, write_text_atomic,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


def _save(root: Path, step: int, payload: str) -> Path:
    with atomic_directory(root / f"step-{step}") as tmp:
        (tmp / "weights.bin").write_text(payload)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "state.json").write_text(json.dumps({"step": step}))
        mark_complete(tmp)
    return root / f"step-{step}"


def _hidden(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_success_creates_final_with_marker(tmp_path):
    final = _save(tmp_path, 1, "w1")
    assert (final / COMPLETE).is_file()
    assert (final / "weights.bin").read_text() == "w1"
    assert json.loads((final / "sub" / "state.json").read_text()) == {"step": 1}
    assert _hidden(tmp_path) == []


def test_exception_keeps_previous_and_removes_temp(tmp_path):
    _save(tmp_path, 1, "old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_directory(tmp_path / "step-1") as tmp:
            (tmp / "weights.bin").write_text("new-but-broken")
            mark_complete(tmp)
            raise RuntimeError("boom")
    assert (tmp_path / "step-1" / "weights.bin").read_text() == "old"
    assert _hidden(tmp_path) == []


def test_replace_existing_final(tmp_path):
    _save(tmp_path, 1, "old")
    (tmp_path / "step-1" / "stale-extra-file").write_text("x")
    _save(tmp_path, 1, "new")
    assert (tmp_path / "step-1" / "weights.bin").read_text() == "new"
    assert not (tmp_path / "step-1" / "stale-extra-file").exists()  # replaced, not merged
    assert _hidden(tmp_path) == []


def test_list_and_latest_ignore_incomplete_and_temp(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    for step in (2, 10, 1):
        _save(tmp_path, step, str(step))
    (tmp_path / "step-20").mkdir()                  # no COMPLETE marker
    (tmp_path / ".step-30.tmp-12345").mkdir()       # a writer's temp dir
    mark_complete(tmp_path / ".step-30.tmp-12345")
    (tmp_path / "step-abc").mkdir()
    (tmp_path / "step-7").write_text("a file, not a dir")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1, 2, 10]
    assert latest_checkpoint(tmp_path) == (10, tmp_path / "step-10")


def test_prune_keeps_newest(tmp_path):
    for step in range(1, 6):
        _save(tmp_path, step, str(step))
    (tmp_path / "step-0").mkdir()  # incomplete: not ours to judge, left alone
    removed = prune_checkpoints(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["step-1", "step-2", "step-3"]
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert (tmp_path / "step-0").is_dir()
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, keep=-1)


def _killed_writer(root: Path, step: int, stage: str) -> int:
    """Run a child that starts writing step-<step> and SIGKILLs itself at `stage`; return its pid."""
    code = textwrap.dedent(f"""
        import os, signal
        from pathlib import Path
        from k3post.track import atomic
        root = Path({str(root)!r})
        def die():
            os.kill(os.getpid(), signal.SIGKILL)
        if {stage!r} == "swap":  # die between moving the old copy aside and renaming the new one in
            real_rename = os.rename
            def rename(src, dst):
                real_rename(src, dst)
                if ".old-" in str(dst):
                    die()
            atomic.os.rename = rename
        with atomic.atomic_directory(root / "step-{step}") as tmp:
            (tmp / "weights.bin").write_text("half-written")
            if {stage!r} == "write":
                die()
            atomic.mark_complete(tmp)
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert child.returncode == -signal.SIGKILL, child.stderr
    return int(next(p.name.rpartition("-")[2] for p in root.iterdir() if p.name.startswith(".")))


def test_killed_writer_leaves_previous_checkpoint(tmp_path):
    _save(tmp_path, 5, "good-weights")
    pid = _killed_writer(tmp_path, 10, "write")  # new step, killed mid-write
    assert _hidden(tmp_path) == [f".step-10.tmp-{pid}"]
    assert latest_checkpoint(tmp_path) == (5, tmp_path / "step-5")
    assert (tmp_path / "step-5" / "weights.bin").read_text() == "good-weights"

    prune_checkpoints(tmp_path, keep=3)  # the writer is dead: its temp dir goes
    assert _hidden(tmp_path) == []
    assert latest_checkpoint(tmp_path) == (5, tmp_path / "step-5")


def test_killed_while_replacing_same_step(tmp_path):
    _save(tmp_path, 5, "good-weights")
    _killed_writer(tmp_path, 5, "write")
    assert (tmp_path / "step-5" / "weights.bin").read_text() == "good-weights"
    assert latest_checkpoint(tmp_path) == (5, tmp_path / "step-5")


def test_killed_mid_swap_is_recovered_by_prune(tmp_path):
    _save(tmp_path, 5, "good-weights")
    pid = _killed_writer(tmp_path, 5, "swap")
    assert latest_checkpoint(tmp_path) is None  # the window atomic renames cannot close
    assert f".step-5.old-{pid}" in _hidden(tmp_path)
    prune_checkpoints(tmp_path, keep=3)
    assert latest_checkpoint(tmp_path) == (5, tmp_path / "step-5")
    assert (tmp_path / "step-5" / "weights.bin").read_text() == "good-weights"
    assert _hidden(tmp_path) == []


def test_write_json_and_text_atomic(tmp_path):
    write_json_atomic(tmp_path / "a" / "state.json", {"step": 3, "name": "ü"})
    assert json.loads((tmp_path / "a" / "state.json").read_text(encoding="utf-8")) == {"step": 3, "name": "ü"}
    write_text_atomic(tmp_path / "a" / "state.json", "replaced")
    assert (tmp_path / "a" / "state.json").read_text() == "replaced"
    assert _hidden(tmp_path / "a") == []
