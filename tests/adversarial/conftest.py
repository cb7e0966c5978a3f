"""Attack tests: floods open hundreds of sockets; the gateway tests reuse the serving pair."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import pytest

# The gateway's hostile-input tests share the serving tests' in-process pair.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "serving"))


@pytest.fixture(autouse=True, scope="session")
def _many_descriptors() -> None:
    """Floods open hundreds of sockets: raise this process's (and its children's) fd limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, 16384) if hard != resource.RLIM_INFINITY else 16384
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
