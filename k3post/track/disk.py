"""What a run directory's space goes to, in one line printed at the end of a run.

Checkpoints are listed one by one with their resume state (`dcp/`: the model and the AdamW
optimizer's state, about 3x the weights in fp32; `trainer_state.pt`: scheduler, RNG, LoRA's
optimizer), which only resuming needs; everything else by its top-level entry."""

from __future__ import annotations

from pathlib import Path

RESUME_STATE = ("dcp", "trainer_state.pt")  # in checkpoints/step-N: what only a resume reads
SHOWN = 4  # the largest entries named; the rest are summed as "other"


def tree_size(path: Path) -> int:
    """Bytes of the regular files under `path` (or of `path` itself), not following links."""
    if path.is_symlink():
        return 0
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def human_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def _entries(run_dir: Path) -> list[tuple[str, int, int]]:
    """(name, bytes, resume-state bytes) per checkpoint and per other top-level entry."""
    entries = []
    for child in sorted(run_dir.iterdir()):
        if child.name == "checkpoints" and child.is_dir():
            for ckpt in sorted(child.iterdir()):
                resume = sum(tree_size(ckpt / name) for name in RESUME_STATE) if ckpt.is_dir() else 0
                entries.append((f"checkpoints/{ckpt.name}", tree_size(ckpt), resume))
        else:
            entries.append((child.name + ("/" if child.is_dir() else ""), tree_size(child), 0))
    return sorted(entries, key=lambda e: -e[1])


def run_dir_usage(run_dir: Path, keep_checkpoints: int) -> str:
    """e.g. 'run directory runs/x holds 3.1 GB: checkpoints/step-20 1.5 GB (resume state dcp/ +
    trainer_state.pt 1.1 GB), ...; keep fewer checkpoints with train.keep_checkpoints (now 2)'."""
    entries = _entries(run_dir)
    total = sum(size for _, size, _ in entries)
    parts = []
    for name, size, resume in entries[:SHOWN]:
        note = f" (resume state dcp/ + trainer_state.pt {human_bytes(resume)})" if resume else ""
        parts.append(f"{name} {human_bytes(size)}{note}")
    rest = sum(size for _, size, _ in entries[SHOWN:])
    if rest:
        parts.append(f"other {human_bytes(rest)}")
    line = f"run directory {run_dir} holds {human_bytes(total)}"
    if parts:
        line += ": " + ", ".join(parts)
    if any(name.startswith("checkpoints/") for name, _, _ in entries):
        line += f"; keep fewer checkpoints with train.keep_checkpoints (now {keep_checkpoints})"
    return line
