"""docs/sizing.md's outputs are what `k3post plan` prints now (tools/sizing_outputs.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("sizing_outputs", REPO / "tools" / "sizing_outputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_command_of_the_sizing_page_prints_the_output_shown_under_it():
    tool = _tool()
    text = tool.PAGE.read_text(encoding="utf-8")
    assert len(tool.commands(text)) == 5  # the three clusters and two fixes
    assert tool.rendered(text) == text


def test_a_stale_output_is_caught():
    tool = _tool()
    text = tool.PAGE.read_text(encoding="utf-8")
    stale = text.replace("verdict: fits", "verdict: fit", 1)
    assert stale != text and tool.rendered(stale) == text
