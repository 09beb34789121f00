"""Every dependency in pyproject.toml earns its place: imported by the package or a test, or
justified by a comment right above its entry; and accelerate's meta-device construction (the
one thing k3post uses it for) builds what the sharded loader needs."""

from __future__ import annotations

import importlib.metadata as md
import re
import tomllib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _imported_modules() -> set[str]:
    text = "\n".join(p.read_text(encoding="utf-8", errors="ignore")
                     for folder in ("k3post", "rewards", "tests", "bench") for p in (REPO / folder).rglob("*.py"))
    return set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", text, re.M))


def _commented(lines: list[str], entry: str) -> bool:
    """Whether the line above `entry` (in a list) or the entry's own line carries a comment."""
    for i, line in enumerate(lines):
        if f'"{entry}"' in line:
            above = lines[i - 1].strip() if i else ""
            return "#" in line.split(f'"{entry}"', 1)[1] or above.startswith("#")
    return False


def test_every_dependency_is_imported_or_justified():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    project, lines = tomllib.loads(text)["project"], text.splitlines()
    modules_of: dict[str, set[str]] = {}
    for module, dists in md.packages_distributions().items():
        for dist in dists:
            modules_of.setdefault(_norm(dist), set()).add(module)
    imported = _imported_modules()
    unearned = []
    for entries in [project["dependencies"], *project["optional-dependencies"].values()]:
        for entry in entries:
            name = _norm(re.match(r"[A-Za-z0-9_.-]+", entry).group())
            if not (modules_of.get(name, set()) & imported) and not _commented(lines, entry):
                unearned.append(entry)
    assert not unearned, f"neither imported by k3post/rewards/tests/bench nor justified by a comment: {unearned}"


def test_parameters_on_meta_keeps_buffers_real_and_matches_a_host_build():
    """The sharded loader builds the student's module tree under accelerate's init_empty_weights
    (model/training/sharded_load.py): parameters on meta (no memory), buffers real, so that the rotary
    inv_freq computed in __init__ equals a host-built model's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from k3post.model.training.sharded_load import parameters_on_meta

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    with parameters_on_meta():
        empty = LlamaForCausalLM(config)
    host = LlamaForCausalLM(config)
    assert all(p.device.type == "meta" for p in empty.parameters())
    assert sum(p.numel() for p in empty.parameters()) == sum(p.numel() for p in host.parameters())
    buffers = dict(empty.named_buffers())
    assert buffers and all(b.device.type == "cpu" for b in buffers.values())
    for name, buffer in host.named_buffers():
        torch.testing.assert_close(buffers[name], buffer)
    assert torch.nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is undone on exit
