"""Fixtures for acceptance tests: the real OpenAI-compatible streaming test server."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

_SERVER_FILE = Path(__file__).resolve().parents[1] / "loadtests" / "openai_sse_server.py"


def _server_module() -> Any:
    name = "openai_sse_server"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _SERVER_FILE)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def sse_server() -> Iterator[Any]:
    """A real OpenAI-compatible SSE server on 127.0.0.1:<ephemeral> (20 ms TTFT, 3 ms gaps)."""
    mod = _server_module()
    server = mod.OpenAIStreamServer(
        mod.StreamServerConfig(first_token_delay_s=0.02, token_gap_s=0.003)
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()
