"""Crash-safe files and checkpoint directories.

A checkpoint is written into a hidden temporary sibling and renamed into place only
once every byte is on disk, so a crash (OOM kill, preemption, Ctrl-C) at any moment
leaves either the old checkpoint or the new one, never a half-written directory under
the real name. Single-writer assumption: temp names carry the pid, and stale-temp
cleanup asks whether that pid is alive on *this* host.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from k3post.track.checkpoint_files import COMPLETE, complete_marker


def _fsync_path(path: Path) -> None:
    """fsync a file or a directory (a directory fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under root, so the rename publishes finished data."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            _fsync_path(Path(dirpath) / name)
        _fsync_path(Path(dirpath))


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to path via temp file + fsync + os.replace: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(path.parent)  # make the rename itself survive a power loss


def write_json_atomic(path: Path, obj: Any) -> None:
    """Atomically write obj as indented JSON (NaN is written as Python's `NaN` rather than failing)."""
    write_text_atomic(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename tmp to final; an existing final is moved aside first (rename cannot overwrite a
    non-empty directory). A crash between the two renames leaves `.{name}.old-<pid>`, which
    prune_checkpoints renames back."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_directory(final: Path) -> Iterator[Path]:
    """Yield a temp sibling of `final` to fill; on success it becomes `final` atomically.

    On an exception the temp dir is removed and the exception re-raised, so the previous
    `final` (if any) is untouched. Call mark_complete(tmp) inside the block.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():  # left by an earlier process that had our (recycled) pid
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
        _fsync_tree(tmp)
        _hold_if_asked(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_dir(tmp, final)


# A fault-injection point for the tests that kill a run mid-write: with this variable set to a
# directory name (e.g. `step-3`), the process writing that directory stops for good right before
# publishing it, so the kill meets a half-written checkpoint whatever the machine's speed.
HOLD_ENV = "K3POST_HOLD_BEFORE_PUBLISH"


def _hold_if_asked(final: Path) -> None:
    if os.environ.get(HOLD_ENV) == final.name:
        while True:
            time.sleep(1)


def mark_complete(directory: Path) -> None:
    """Write the COMPLETE marker, the manifest of every file's size and CRC-32 that a resume
    checks them against (track/checkpoint_files.py); call it last inside atomic_directory: it
    is published with the rest."""
    write_text_atomic(Path(directory) / COMPLETE, complete_marker(directory))


def _parse_step(name: str, prefix: str) -> int | None:
    """Step number of a checkpoint name like 'step-12', or None for anything else."""
    if not name.startswith(prefix):
        return None
    rest = name[len(prefix):]
    return int(rest) if rest.isdigit() else None


def list_checkpoints(root: Path, prefix: str = "step-") -> list[tuple[int, Path]]:
    """Complete checkpoints under root as (step, path), oldest first.

    Temp dirs start with '.' and so never match the prefix; dirs without COMPLETE are skipped.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = _parse_step(entry.name, prefix)
        if step is not None and entry.is_dir() and (entry / COMPLETE).is_file():
            found.append((step, entry))
    return sorted(found, key=lambda item: item[0])


def latest_checkpoint(root: Path, prefix: str = "step-") -> tuple[int, Path] | None:
    """The newest complete checkpoint as (step, path), or None if there is none."""
    found = list_checkpoints(root, prefix)
    return found[-1] if found else None


def _pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (signal 0 only checks)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _stale_temp(entry: Path) -> tuple[str, str] | None:
    """For a '.{name}.tmp-<pid>' / '.{name}.old-<pid>' entry of a dead pid, return (kind, name)."""
    if not entry.name.startswith("."):
        return None
    for kind in ("tmp", "old"):
        base, sep, pid = entry.name[1:].rpartition(f".{kind}-")
        if sep and pid.isdigit() and base and not _pid_alive(int(pid)):
            return kind, base
    return None


def _remove(path: Path) -> None:
    """Remove a file or a directory tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _clean_stale(root: Path) -> list[Path]:
    """Delete temp leftovers of dead writers; restore an '.old' copy whose replacement never landed."""
    removed = []
    for entry in list(root.iterdir()):
        stale = _stale_temp(entry)
        if stale is None:
            continue
        kind, base = stale
        if kind == "old" and not (root / base).exists():
            os.rename(entry, root / base)  # the writer died mid-swap: the old copy is the only one
            continue
        _remove(entry)
        removed.append(entry)
    return removed


def prune_checkpoints(root: Path, keep: int, prefix: str = "step-") -> list[Path]:
    """Keep the newest `keep` complete checkpoints, delete older ones and dead writers' temp dirs.

    Directories without a COMPLETE marker are left alone: they are not ours to judge.
    Returns the removed paths.
    """
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    root = Path(root)
    if not root.is_dir():
        return []
    removed = _clean_stale(root)
    checkpoints = list_checkpoints(root, prefix)
    for _step, path in checkpoints[: max(len(checkpoints) - keep, 0)]:
        shutil.rmtree(path)
        removed.append(path)
    return removed
