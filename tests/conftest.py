"""Shared test fixtures."""

from __future__ import annotations

import os

import pytest

# Before any test module imports grpc: pdx sets gRPC's TLS 1.2 cipher suites when it is
# imported (pdx.GRPC_TLS12_SUITES), which gRPC reads once, at its own import.
import pdx  # noqa: F401

# Tests never reach a hub; models are built from configs with random weights.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """System tests need root for network namespaces; skip them cleanly without it.

    Under ``pytest -n N --dist loadgroup`` (make test's first pass) a module's tests stay on
    one worker, so a module-scoped server starts once; tests that build network namespaces
    share one group and run one after the other (each owns its namespaces, but the host's
    routes and addresses are shared).
    """
    root = os.geteuid() == 0
    skip = pytest.mark.skip(reason="needs root for network namespaces")
    for item in items:
        system = "system" in item.keywords
        if system and not root:
            item.add_marker(skip)
        group = "netns" if system else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))
