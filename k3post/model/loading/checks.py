"""Checks of a model directory before any weight is loaded.

`from_pretrained` on a damaged directory fails deep inside transformers or safetensors with an
exception that often does not say which file is wrong (`HeaderTooLarge`, `JSONDecodeError`,
"Error while deserializing header"), and only after seconds of work. The checks here read a few
kilobytes and name the file:

- `config.json` exists, is UTF-8 text, and is a JSON object;
- a tokenizer is there (tokenizer.json, tokenizer.model, vocab.json or tokenizer_config.json);
- at least one weight file, and each `*.safetensors` file is whole, judged from its header
  (config/weight_files.py). A sharded checkpoint's `model.safetensors.index.json` must name only
  files that exist.

`check_family` is separate: a causal LM's `model_type` must be a family k3post accepts
(model/families.py); reward models (any sequence classifier) are not held to it.
"""

from __future__ import annotations

import json
from pathlib import Path

from k3post.config.errors import UserError, located, shorten
from k3post.config.text_files import read_text
from k3post.config.weight_files import safetensors_problem
from k3post.model.families import unaccepted_family

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


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


def declares_quantization(directory: Path | str) -> bool:
    """Whether a HF directory's config declares a quantization scheme (k3post's compressed-tensors FP8
    export); False without a config.json, a UserError naming the file if it is not a JSON object."""
    config = Path(directory) / "config.json"
    return config.is_file() and "quantization_config" in read_json_object(config, "model config")


def check_safetensors_header(path: Path) -> None:
    """A UserError naming `path` if its header says it is not a whole safetensors file."""
    problem = safetensors_problem(path)
    if problem is not None:
        raise UserError(located(path, problem))


def _check_index(directory: Path) -> None:
    for index in directory.glob("*.safetensors.index.json"):
        weight_map = read_json_object(index, "weight index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(located(index, "expected a 'weight_map' object", key="weight_map"))
        missing = sorted({str(f) for f in weight_map.values()} - {p.name for p in directory.iterdir()})
        if missing:
            raise UserError(located(index, f"names weight files that are not in {directory}: "
                                           f"{shorten(', '.join(missing))}"))


def check_family(directory: Path) -> None:
    """A UserError naming the directory, its model_type and the accepted list when the causal LM
    there is not of a family in model/families.py (config.json only: no weights touched)."""
    config = read_json_object(Path(directory) / "config.json", "model config")
    problem = unaccepted_family(config.get("model_type"))
    if problem is not None:
        raise UserError(located(directory, problem))


def check_model_dir(directory: Path, need_tokenizer: bool = True) -> None:
    """Everything a Hugging Face model directory needs before its weights are loaded (see the
    module docstring); raises a UserError naming the directory or the file that is wrong."""
    directory = Path(directory)
    if not directory.exists():
        raise UserError(located(directory, "model directory not found (expected a Hugging Face model directory "
                                           "with config.json)"))
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
