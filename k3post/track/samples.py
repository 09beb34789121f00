"""Sample generations: saved per step as JSONL, and shown as a readable before/after block.

A row is a flat dict such as {"prompt": ..., "before": ..., "after": ..., "teacher:math": ...};
"prompt" is shown first, every other key as one model's (or one score's) line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from k3post.track.atomic import write_text_atomic

SAMPLES_DIR = "samples"


def _jsonable(value: Any) -> Any:
    """json.dumps fallback: tensors/numpy values via item()/tolist(), anything else as str."""
    for method in ("item", "tolist"):
        try:
            return getattr(value, method)()
        except (AttributeError, RuntimeError, ValueError):
            continue
    return str(value)


def write_samples(run_dir: Path, step: int, rows: list[dict]) -> Path:
    """Write rows to run_dir/samples/step-{step}.jsonl atomically (one JSON object per row)."""
    path = Path(run_dir) / SAMPLES_DIR / f"step-{step}.jsonl"
    text = "".join(json.dumps(row, ensure_ascii=False, default=_jsonable) + "\n" for row in rows)
    write_text_atomic(path, text)
    return path


def _truncate(value: Any, max_chars: int) -> str:
    """One terminal line: newlines shown as ' ⏎ ', cut at max_chars with the number cut."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=_jsonable)
    text = text.strip().replace("\r\n", "\n").replace("\n", " ⏎ ")
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}… (+{len(text) - max_chars} chars)"


def format_samples_table(rows: list[dict], max_chars: int = 200) -> str:
    """A text block per row: the prompt, then each model's completion, each truncated."""
    blocks = []
    for index, row in enumerate(rows, start=1):
        keys = (["prompt"] if "prompt" in row else []) + [k for k in row if k != "prompt"]
        width = max((len(k) for k in keys), default=0)
        lines = [f"── sample {index}/{len(rows)} " + "─" * 20]
        lines += [f"{k:>{width}}: {_truncate(row[k], max_chars)}" for k in keys]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)
