"""The end-of-run line on what a run directory's space goes to (k3post/track/disk.py)."""

from __future__ import annotations

from pathlib import Path

from k3post.track.disk import human_bytes, run_dir_usage, tree_size


def write(path: Path, size: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)


def test_checkpoints_by_directory_with_their_resume_state(tmp_path):
    run = tmp_path / "run"
    for step, scale in (("step-10", 1), ("step-20", 2)):
        write(run / "checkpoints" / step / "model.safetensors", 1000 * scale)
        write(run / "checkpoints" / step / "dcp" / "__0_0.distcp", 3000 * scale)
        write(run / "checkpoints" / step / "trainer_state.pt", 100 * scale)
    write(run / "metrics.jsonl", 50)
    write(run / "tensorboard" / "events", 200)
    assert tree_size(run) == 4100 + 8200 + 50 + 200
    assert run_dir_usage(run, keep_checkpoints=2) == (
        f"run directory {run} holds 12.3 KB: checkpoints/step-20 8.0 KB (resume state dcp/ + trainer_state.pt "
        "6.1 KB), checkpoints/step-10 4.0 KB (resume state dcp/ + trainer_state.pt 3.0 KB), tensorboard/ 200 B, "
        "metrics.jsonl 50 B; keep fewer checkpoints with train.keep_checkpoints (now 2)")


def test_small_entries_are_summed_and_no_checkpoint_hint_without_checkpoints(tmp_path):
    for i, size in enumerate((500, 400, 300, 200, 10, 5)):
        write(tmp_path / f"f{i}", size)
    assert run_dir_usage(tmp_path, keep_checkpoints=1) == (
        f"run directory {tmp_path} holds 1.4 KB: f0 500 B, f1 400 B, f2 300 B, f3 200 B, other 15 B")


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KB"
    assert human_bytes(3 * 1024**3) == "3.0 GB"
    assert human_bytes(5 * 1024**4) == "5120.0 GB"
