"""Shared fixtures: tiny random models built from a config (no network, seconds on a CPU)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from k3post.config.schema import ModelSpec, TinyModelSpec
from k3post.engine.common import quiet_libraries

REPO = Path(__file__).resolve().parent.parent

quiet_libraries()
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def tiny_spec() -> ModelSpec:
    return ModelSpec(tiny=TinyModelSpec(hidden_size=32, num_layers=2, seed=3))


@pytest.fixture
def tiny_model(tiny_spec):
    from k3post.model.loading.load import load_model

    return load_model(tiny_spec)


def pytest_collection_modifyitems(config, items):
    if os.environ.get("K3POST_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set K3POST_SLOW=1 to run")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
