"""Schemathesis against a live gateway: generated requests from its own OpenAPI document.

Positive and negative cases for every route of ``/openapi.json`` (bodies of every field's
type and range, and bodies that break them). Over at least 500 requests: no response is a
server error (>= 500) and every response conforms to the document (status code, content
type, headers, body schema). Cross-field rules the schema cannot express (prompt + max_tokens
within the context, a token id inside the vocabulary) are 400s the document lists, so
schemathesis' "positive data must be accepted" check is not among those asked for.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_deploy import live_deployment

pytestmark = pytest.mark.slow

# A short context keeps every generated request to a few dozen tokens of real decoding.
OVERRIDES = ["gateway.port=0", "model.max_context_tokens=48", "router.local_prefill_max_tokens=8",
             "kv.kv_transfer_timeout_ms=10000"]  # fmt: skip
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance")  # fmt: skip
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


@pytest.fixture(scope="module")
def gateway() -> Iterator[str]:
    with live_deployment(OVERRIDES) as dep:
        yield dep.endpoints().gateway


def test_generated_requests_never_fail_the_server_or_the_document(
    gateway: str, tmp_path: Path
) -> None:
    har = tmp_path / "run.har"
    cmd = [str(SCHEMATHESIS), "run", f"{gateway}/openapi.json", "--checks", CHECKS,
           "--max-examples", "90", "--seed", "20261201", "--workers", "2",
           "--phases", "examples,coverage,fuzzing", "--request-timeout", "60",
           "--generation-database", "none", "--no-color", "--report", "har",
           "--report-har-path", str(har)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    entries = json.loads(har.read_text())["log"]["entries"]
    statuses = Counter(e["response"]["status"] for e in entries)
    summary = f"{len(entries)} requests, statuses {dict(sorted(statuses.items()))}"
    print(summary)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert len(entries) >= 500, summary
    assert not [s for s in statuses if s >= 500], summary
    assert statuses[200] >= 100, summary  # real completions were served, not only refusals
