"""Rendering ``pdx deploy --render k8s`` through the CLI and reading the manifests back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from pdx.cli.main import app

Docs = list[dict[str, Any]]


def render(out: Path, sets: list[str]) -> dict[str, Docs]:
    """``pdx deploy --render k8s OUT --set ...``; the documents of each ``site-*.yaml``."""
    args = ["deploy", "--render", "k8s", str(out), "--json"]
    for item in sets:
        args += ["--set", item]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return {p.name: list(yaml.safe_load_all(p.read_text())) for p in out.glob("site-*.yaml")}


def by_kind(docs: Docs, kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    c: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return c


def validate_strict(sites: dict[str, Docs]) -> None:
    """Every document against the Kubernetes schema, unknown fields rejected: what
    ``kubernetes-validate --strict FILE`` checks."""
    kv = pytest.importorskip("kubernetes_validate")
    version = kv.latest_version()
    for name, docs in sites.items():
        for doc in docs:
            try:
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as exc:
                kind, doc_name = doc["kind"], doc["metadata"]["name"]
                pytest.fail(f"{name}: {kind}/{doc_name}: {exc.message} at {list(exc.path)}")
