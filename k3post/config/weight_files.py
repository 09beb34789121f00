"""Is a weight file whole? Read from its header alone (stdlib only: shared by model/loading/checks.py,
which checks model directories, and track/run_dir.py, which checks checkpoints).

A safetensors file is `[u64 little-endian N][N bytes of JSON header][tensor bytes]`; the header
gives each tensor's `data_offsets` into the tensor bytes, so a file cut short (an interrupted
copy, a full disk) has a header whose largest end offset lies past the end of the file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with a .safetensors file, in words, or None if its header says it is whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                return f"expected a safetensors file, got {size} bytes (truncated or empty)"
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                return "expected a safetensors file: its header length is larger than the file (truncated, or not " \
                       "a safetensors file)"
            raw = f.read(header_len)
    except PermissionError:
        return "cannot read this weight file: permission denied"
    except OSError as err:
        return f"cannot read this weight file: {err.strerror or err}"
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "expected a safetensors file: its header is not JSON (damaged file)"
    if not isinstance(header, dict):
        return "expected a safetensors file: its header is not a JSON object"
    tensors = [v for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    ends = [v["data_offsets"][1] for v in tensors if isinstance(v.get("data_offsets"), list)
            and len(v["data_offsets"]) == 2 and isinstance(v["data_offsets"][1], int)]
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        return (f"truncated weight file: its header lists {len(tensors)} tensors ending at byte {needed:,}, the file "
                f"has {size:,} bytes (re-copy or re-save it)")
    return None
