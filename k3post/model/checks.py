"""Checks of a model directory before any weight is loaded.

`from_pretrained` on a damaged directory fails deep inside transformers or safetensors with an
exception that often does not say which file is wrong (`HeaderTooLarge`, `JSONDecodeError`,
"Error while deserializing header"), and only after seconds of work. The checks here read a few
kilobytes and name the file:

- `config.json` exists, is UTF-8 text, and is a JSON object;
- a tokenizer is there (tokenizer.json, tokenizer.model, vocab.json or tokenizer_config.json);
- at least one weight file, and each `*.safetensors` file is whole. A safetensors file is
  `[u64 little-endian N][N bytes of JSON header][tensor bytes]`, and the header gives every
  tensor's `data_offsets` into the tensor bytes: a file cut short (an interrupted copy) has a
  header whose largest end offset lies past the end of the file. A sharded checkpoint's
  `model.safetensors.index.json` must name only files that exist.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from k3post.config.errors import UserError, located, shorten
from k3post.config.text_files import read_text

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit on the JSON header


def read_json_object(path: Path, what: str) -> dict:
    """A JSON object from a file, or a UserError naming the file and the line."""
    try:
        data = json.loads(read_text(path, what))
    except json.JSONDecodeError as err:
        raise UserError(located(path, f"line {err.lineno}: expected a JSON {what}: {err.msg} at column "
                                      f"{err.colno}")) from None
    if not isinstance(data, dict):
        raise UserError(located(path, f"expected a JSON object ({what})", got=f"a {type(data).__name__}"))
    return data


def check_safetensors_header(path: Path) -> int:
    """Read a .safetensors file's header and check the file holds every tensor it lists; returns
    the number of tensors."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise UserError(located(path, f"expected a safetensors file, got {size} bytes (truncated or empty)"))
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise UserError(located(path, "expected a safetensors file: its header length is larger than the "
                                              "file (truncated, or not a safetensors file)"))
            raw = f.read(header_len)
    except PermissionError:
        raise UserError(located(path, "cannot read this weight file: permission denied")) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise UserError(located(path, "expected a safetensors file: its header is not JSON (damaged file)")) from None
    if not isinstance(header, dict):
        raise UserError(located(path, "expected a safetensors file: its header is not a JSON object"))
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    ends = [v.get("data_offsets", [0, 0])[1] for v in tensors.values() if isinstance(v, dict)]
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise UserError(located(path, f"truncated weight file: its header lists {len(tensors)} tensors ending at "
                                      f"byte {needed:,}, the file has {size:,} bytes (re-copy or re-save it)"))
    return len(tensors)


def _check_index(directory: Path) -> None:
    for index in directory.glob("*.safetensors.index.json"):
        weight_map = read_json_object(index, "weight index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(located(index, "expected a 'weight_map' object", key="weight_map"))
        missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in directory.iterdir()})
        if missing:
            raise UserError(located(index, f"names weight files that are not in {directory}: "
                                           f"{shorten(', '.join(missing))}"))


def check_model_dir(directory: Path, need_tokenizer: bool = True) -> None:
    """Everything a Hugging Face model directory needs before its weights are loaded (see the
    module docstring); raises a UserError naming the directory or the file that is wrong."""
    directory = Path(directory)
    if not directory.exists():
        raise UserError(located(directory, "model directory not found"))
    if not directory.is_dir():
        raise UserError(located(directory, "expected a Hugging Face model directory, found a file"))
    config = directory / "config.json"
    if not config.is_file():
        raise UserError(located(directory, "expected a Hugging Face model directory with config.json (none here)"))
    read_json_object(config, "model config")
    if need_tokenizer and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(located(directory, f"no tokenizer in the model directory (expected one of "
                                           f"{', '.join(TOKENIZER_FILES)}); save it with tokenizer.save_pretrained"))
    weights = sorted(directory.glob("*.safetensors"))
    if not weights and not any(directory.glob("pytorch_model*.bin")):
        raise UserError(located(directory, "no weight files (*.safetensors or pytorch_model*.bin) in the model "
                                           "directory"))
    for path in weights:
        check_safetensors_header(path)
    _check_index(directory)
