"""Shared test fixtures."""

from __future__ import annotations

import os

import pytest

# Tests never reach a hub; models are built from configs with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """System tests need root for network namespaces; skip them cleanly without it."""
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root for network namespaces")
    for item in items:
        if "system" in item.keywords:
            item.add_marker(skip)
