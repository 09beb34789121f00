"""Is a checkpoint whole? The checks a resume makes before it trusts a checkpoint marked COMPLETE.

Every checkpoint k3post writes (the one-process learner's, a sharded group's, a LoRA run's) ends
with `mark_complete`, whose COMPLETE marker is a manifest: each file's size and CRC-32, taken
just before the directory is published. A resume compares the files with it, which catches what
no format check can: bytes changed in the middle of a weight file (a bad disk, a bad copy), a
file gone, a file cut short. CRC-32 runs at ~3 GB/s on one core, a fraction of the time the
checkpoint took to write.

Checkpoints written before the manifest (COMPLETE holds the word `complete`) get the format
checks alone, which every checkpoint also passes:
- weight files: at least one, and each safetensors header covers its file (config/weight_files.py);
- `run_state.json` and `config.json` parse as JSON objects;
- `dcp/` (model + optimizer through torch.distributed.checkpoint): `.metadata` loads, and every
  storage file it names exists and is long enough for the byte range it names;
- `trainer_state.pt` (a torch zip): its records' CRCs, which torch writes, hold.
"""

from __future__ import annotations

import json
import os
import zipfile
import zlib
from pathlib import Path

from k3post.config.weight_files import safetensors_problem

COMPLETE = "COMPLETE"
RUN_STATE = "run_state.json"  # what the learner writes beside the weights (engine/learner/learner.py)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".distcp")
CHUNK = 8 * 2**20
# Not in the manifest: the marker itself, and the model card, which `k3post eval --update-cards`
# appends results to after the checkpoint was written (a resume never reads it).
UNLISTED = (COMPLETE, "README.md")


def crc32_of(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            crc = zlib.crc32(block, crc)
    return crc


def manifest_of(directory: Path) -> dict[str, list[int]]:
    """{path relative to `directory`: [size, crc32]} for every file under it but UNLISTED."""
    directory = Path(directory)
    files = {}
    for dirpath, _dirs, names in os.walk(directory):
        for name in names:
            path = Path(dirpath) / name
            relative = path.relative_to(directory).as_posix()
            if relative not in UNLISTED:
                files[relative] = [path.stat().st_size, crc32_of(path)]
    return dict(sorted(files.items()))


def complete_marker(directory: Path) -> str:
    """The text of `directory`'s COMPLETE marker: its manifest, as JSON."""
    return json.dumps({"format": 1, "files": manifest_of(directory)}, indent=1) + "\n"


def read_manifest(directory: Path) -> dict[str, list[int]] | None:
    """The manifest in `directory`'s COMPLETE marker; None for a marker without one."""
    try:
        marker = json.loads((Path(directory) / COMPLETE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    files = marker.get("files") if isinstance(marker, dict) else None
    return files if isinstance(files, dict) else None


def manifest_problem(directory: Path, files: dict[str, list[int]]) -> str | None:
    """The first file that differs from the manifest, in words (None if every one matches)."""
    for relative, (size, crc) in files.items():
        path = Path(directory) / relative
        if not path.is_file():
            return f"{relative} is missing (the COMPLETE manifest lists it)"
        if path.stat().st_size != size:
            return f"{relative} has {path.stat().st_size:,} bytes, it was written with {size:,} (cut short or replaced)"
        if crc32_of(path) != crc:
            return f"{relative}: its bytes changed since it was written (CRC-32 differs from the COMPLETE manifest)"
    return None


def _json_problem(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path.name}: expected a JSON object, cannot read it ({type(err).__name__})"
    return None if isinstance(value, dict) else f"{path.name}: expected a JSON object, got {type(value).__name__}"


def _zip_problem(path: Path) -> str | None:
    """A torch-saved file (a zip archive) whose records do not match their CRCs, in words."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (OSError, zipfile.BadZipFile, EOFError) as err:
        return f"{path.name}: expected a torch-saved file (a zip archive), cannot read it ({err})"
    return None if bad is None else f"{path.name}: record {bad} does not match its CRC (damaged file)"


def dcp_problem(directory: Path) -> str | None:
    """What is wrong with a DCP directory (`dcp/`, a draft head's `mtp_dcp/`), from its metadata:
    the metadata itself, and every storage file it names (present, long enough for the byte range
    it names)."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415 (torch only for dcp/)

    name = directory.name
    if not (directory / ".metadata").is_file():
        return f"{name}/.metadata is missing"
    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
    except Exception as err:  # a damaged pickle raises whatever the bytes make of it
        return f"{name}/.metadata cannot be read ({type(err).__name__}: damaged file)"
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for relative, end in sorted(ends.items()):
        path = directory / relative
        if not path.is_file():
            return f"{name}/{relative} is missing ({name}/.metadata names it)"
        if path.stat().st_size < end:
            return f"{name}/{relative} is cut short: {path.stat().st_size:,} bytes, {name}/.metadata needs {end:,}"
    return None


def format_problem(path: Path) -> str | None:
    """The format checks (see the module docstring), in words; None if all pass."""
    weights = [p for p in path.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()]
    if not weights:
        return "no weight files in it"
    for weight in weights:
        problem = safetensors_problem(weight) if weight.suffix == ".safetensors" else None
        if problem is not None:
            return f"{weight.name}: {problem}"
    if not (path / RUN_STATE).is_file():
        return f"{RUN_STATE} is missing"
    checks = [_json_problem(path / RUN_STATE)]
    checks += [_json_problem(path / "config.json")] if (path / "config.json").exists() else []
    checks += [dcp_problem(path / name) for name in ("dcp", "mtp_dcp") if (path / name).is_dir()]
    checks += [_zip_problem(p) for p in sorted(path.glob("*.pt"))]
    return next((c for c in checks if c is not None), None)


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint marked COMPLETE cannot be resumed from (None if it can): its files
    against the COMPLETE manifest when it has one, then the format checks."""
    files = read_manifest(path)
    return (manifest_problem(path, files) if files is not None else None) or format_problem(path)
