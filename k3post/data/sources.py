"""Loading prompt rows from a source spec: `builtin:<name>` or a .jsonl/.json/.parquet file.

Every row comes back normalised to {"id": str, "messages": [(role, content), ...], **other
fields} (a `prompt` string becomes one user turn). Mistakes in the user's file raise a
`UserError` that names the file, the row (0-based, the same index a generated id uses) and what
was expected, because the user has to find and fix that row: `FILE: row N: what (got …)`.
A file that is not UTF-8 text, or cannot be read, is reported the same way (config/text_files.py).
Chat roles must be ones a chat template renders (`ROLES`): a typo such as `asistant` would
otherwise be rendered as an unknown role, or silently dropped, and trained on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3post.config.errors import UserError, located, shorten
from k3post.config.text_files import check_readable_file, read_text
from k3post.data.builtin_prompts import builtin_prompt_set

_BUILTIN_PREFIX = "builtin:"
_SUFFIXES = (".jsonl", ".json", ".parquet")
_EXPECTED = "expected a string field 'prompt' or a list field 'messages' of {role, content}"
ROLES = ("system", "user", "assistant", "tool")
# Set on the rows of a source's held-out file (`heldout_prompts`): the mixture holds out exactly
# these rows instead of picking `heldout` rows of the training file by a hash of their ids.
HELDOUT_MARK = "_k3post_heldout"


# Tokens that chat templates write around turns. A prompt holding them is an already rendered
# chat: k3post renders it again through the template, so the model sees the markup as user text.
TEMPLATE_MARKERS = ("<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|eot_id|>", "<|begin_of_text|>",
                    "[INST]", "[/INST]", "<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>",
                    "<|system|>", "<|endoftext|>", "<｜User｜>", "<｜Assistant｜>", "<|im_user|>", "<|im_assistant|>")


def prerendered_rows(rows: list[dict]) -> tuple[list[int], str | None]:
    """(indices of rows whose messages contain chat-template tokens, the first token found)."""
    found, first = [], None
    for index, row in enumerate(rows):
        text = "\n".join(str(content) for _, content in row["messages"])
        hit = next((m for m in TEMPLATE_MARKERS if m in text), None)
        if hit is not None:
            found.append(index)
            first = first or hit
    return found, first


def load_source_rows(prompts: str, heldout_prompts: str | None, base_dir: Path) -> list[dict]:
    """A source's rows: those of `prompts` and, when the source names a held-out file, that
    file's rows marked with HELDOUT_MARK. An id in both files is an error: a held-out prompt that
    is also trained on measures memory, not generalisation."""
    rows = load_prompt_rows(prompts, base_dir)
    if heldout_prompts is None:
        return rows
    held = load_prompt_rows(heldout_prompts, base_dir)
    train_ids = {row["id"] for row in rows}
    for index, row in enumerate(held):
        if row["id"] in train_ids:
            raise UserError(located(heldout_prompts, f"id {shorten(row['id'])} is also a row of the training file "
                                                     f"{shorten(prompts)}; held-out prompts must not be trained on "
                                                     "(give the rows distinct ids)", row=index))
    return rows + [{**row, HELDOUT_MARK: True} for row in held]


def load_prompt_rows(spec: str, base_dir: Path) -> list[dict]:
    """The normalised rows of `spec`; a relative path is resolved against `base_dir`."""
    if spec.startswith(_BUILTIN_PREFIX):
        name = spec[len(_BUILTIN_PREFIX):]
        return _normalise_rows(builtin_prompt_set(name), label=spec, stem=name)
    path = Path(spec).expanduser()
    if not path.is_absolute():
        path = Path(base_dir) / path
    path = path.resolve()
    if not path.exists():
        raise UserError(located(path, f"prompt file not found (the recipe says {shorten(spec)})"))
    check_readable_file(path, "data file")
    if path.suffix not in _SUFFIXES:
        raise UserError(located(path, f"unsupported file type; expected one of {', '.join(_SUFFIXES)} "
                                      "(or builtin:<name>)", got=path.suffix or "no suffix"))
    readers = {".jsonl": _read_jsonl, ".json": _read_json, ".parquet": _read_parquet}
    rows = readers[path.suffix](path)
    if not rows:
        raise UserError(located(path, "no rows in the file"))
    return _normalise_rows(rows, label=str(path), stem=path.stem)


def _read_jsonl(path: Path) -> list[Any]:
    """One JSON value per non-blank line; a bad line is reported by its 1-based line number."""
    rows = []
    for line_no, line in enumerate(read_text(path, "data file").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise UserError(located(path, f"line {line_no} (row {len(rows)}): invalid JSON: {e.msg} at column "
                                          f"{e.colno}")) from None
        except RecursionError:
            raise UserError(located(path, f"line {line_no} (row {len(rows)}): JSON nested too deeply")) from None
    return rows


def _read_json(path: Path) -> list[Any]:
    """A JSON list of rows; a file of JSON lines named .json is accepted too, as `datasets` does."""
    text = read_text(path, "data file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several top-level values: treat it as JSON lines
            return _read_jsonl(path)
        raise UserError(located(path, f"line {e.lineno}: invalid JSON: {e.msg} at column {e.colno}")) from None
    except RecursionError:
        raise UserError(located(path, "JSON nested too deeply")) from None
    if isinstance(data, dict):  # a single row written as an object
        data = [data]
    if not isinstance(data, list):
        raise UserError(located(path, "expected a JSON list of row objects", got=f"a {type(data).__name__}"))
    return data


def _read_parquet(path: Path) -> list[Any]:
    """Parquet goes through `datasets` (imported here: it is slow to import and optional)."""
    import datasets

    try:
        table = datasets.load_dataset("parquet", data_files=str(path), split="train")
    except Exception as e:  # a corrupt or non-parquet file: say which file, keep the cause
        raise UserError(located(path, f"could not read this parquet file: {shorten(str(e), 200)}")) from e
    return table.to_list()


def _normalise_rows(rows: list[Any], label: str, stem: str) -> list[dict]:
    """Validate every row and give it a string id and (role, content) messages; ids must be unique."""
    out: list[dict] = []
    first_row_of: dict[str, int] = {}
    for index, row in enumerate(rows):
        norm = _normalise_row(row, index, label, stem)
        if norm["id"] in first_row_of:
            raise UserError(located(label, f"duplicate id {shorten(norm['id'])} (first used by row "
                                           f"{first_row_of[norm['id']]}); ids must be unique within a source",
                                    row=index))
        first_row_of[norm["id"]] = index
        out.append(norm)
    return out


def _normalise_row(row: Any, index: int, label: str, stem: str) -> dict:
    where = f"{label}: row {index}"
    if not isinstance(row, dict):
        raise UserError(f"{where}: {_EXPECTED}, got a {type(row).__name__} instead of an object")
    # Columnar formats fill fields a row lacks with None, so None counts as absent.
    messages, prompt = row.get("messages"), row.get("prompt")
    if messages is not None:
        turns = _parse_messages(messages, where)
    elif isinstance(prompt, str) and prompt.strip():
        turns = [("user", prompt)]
    else:
        raise UserError(f"{where}: {_EXPECTED}")
    row_id = row.get("id")
    if row_id is None:
        row_id = f"{stem}-{index}"
    elif isinstance(row_id, bool) or not isinstance(row_id, (str, int)) or str(row_id) == "":
        raise UserError(f"{where}: field 'id' must be a non-empty string or an integer (got {shorten(row_id)})")
    rest = {k: v for k, v in row.items() if k not in ("id", "messages", "prompt")}
    return {"id": str(row_id), "messages": turns, **rest}


def _parse_messages(messages: Any, where: str) -> list[tuple[str, str]]:
    """A non-empty list of {role, content} objects with string values, as (role, content) pairs."""
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: {_EXPECTED} (field 'messages' is not a non-empty list)")
    turns = []
    for i, msg in enumerate(messages):
        ok = (isinstance(msg, dict) and isinstance(msg.get("role"), str) and msg["role"]
              and isinstance(msg.get("content"), str))
        if not ok:
            raise UserError(f"{where}: messages[{i}]: expected an object with string fields 'role' and "
                            f"'content' (got {shorten(msg)})")
        if msg["role"] not in ROLES:
            raise UserError(f"{where}: messages[{i}].role: expected one of {', '.join(ROLES)} "
                            f"(got {shorten(msg['role'])})")
        turns.append((msg["role"], msg["content"]))
    return turns
