"""The audit log is append-only JSONL and every provoked error leaves a record."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pdx.transfer.audit import AuditLog, read_audit
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVError, KVErrorCode, ManualClock, new_kv_id


def test_appends_and_never_rewrites(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    AuditLog(path).record("put", kv_id="k1", bytes=3, outcome="ok")
    log = AuditLog(path)
    log.record("release", kv_id="k1", bytes=3, outcome="ok", reason="released")
    log.close()
    recs = read_audit(path)
    assert [r["event"] for r in recs] == ["put", "release"]
    assert recs[0]["ts"].endswith("Z") and recs[1]["reason"] == "released"


async def test_every_outcome_leaves_a_record(
    tmp_path, kv_server_factory, kv_client_cfg, kv_audit
) -> None:
    clock = ManualClock()
    server, target = await kv_server_factory(clock=clock, budget_bytes=600_000)
    ghost = new_kv_id("m", 1)
    async with KVClient(target, kv_client_cfg(client_id="decode-7"), audit=kv_audit) as kv:
        a = await kv.put(os.urandom(250_000))
        await kv.get(a)
        await kv.renew(a)
        await kv.release(a)
        b = await kv.put(os.urandom(250_000))
        for _ in range(3):
            await kv.put(os.urandom(250_000))  # evicts b
        c = await kv.put(os.urandom(1000))
        clock.advance(300)
        for kv_id in (ghost, c):
            with pytest.raises(KVError):
                await kv.get(kv_id)
    recs = read_audit(server.service.cfg.audit_path)
    seen = {(r["event"], r["outcome"]) for r in recs}
    for want in [
        ("put", "ok"),
        ("get", "ok"),
        ("renew", "ok"),
        ("release", "ok"),
        ("release", "deleted"),
        ("evict", "deleted"),
        ("expire", "deleted"),
        ("get", "KV_NOT_FOUND"),
        ("get", "KV_EXPIRED"),
    ]:
        assert want in seen, want
    deletions = [r for r in recs if r["outcome"] == "deleted"]
    assert all(len(r["object_digest"]) == 16 and r["reason"] for r in deletions)
    assert any(r["kv_id"] == b and r["event"] == "evict" for r in deletions)
    assert all(r["who"] == "client=decode-7" for r in recs if r["event"] in ("get", "put"))
    client_side = read_audit(kv_audit.path)
    assert {r["outcome"] for r in client_side} >= {"ok", "KV_NOT_FOUND", "KV_EXPIRED"}
    assert KVErrorCode.KV_EXPIRED.value in {r["outcome"] for r in recs}
