"""Put/Get/Release/Renew/Stat over real gRPC on loopback, and every lifetime error."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from pdx.transfer.audit import read_audit
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVError, KVErrorCode, new_kv_id, parse_kv_id


async def test_put_get_roundtrip_bytes_and_info(kv_server_factory, kv_client_cfg) -> None:
    _, target = await kv_server_factory()
    data = os.urandom(300_000)  # 5 chunks of 64 KiB, the last one short
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(data, model_version="llama-3.1-8b:r1")
        obj = await kv.get(kv_id)
        info = await kv.stat(kv_id)
    assert bytes(obj.data) == data
    parsed = parse_kv_id(kv_id)
    assert parsed.model_version == "llama-3.1-8b:r1"
    assert info.num_chunks == 5 and info.size_bytes == len(data)
    assert info.ttl_s == 120 and info.created_at_ms == parsed.created_at_ms
    assert [r.outcome for r in kv.records()] == ["ok", "ok", "ok"]


async def test_kv_id_is_unguessable_and_carries_version_and_time() -> None:
    ids = {new_kv_id("m-1", 1_700_000_000_000) for _ in range(1000)}
    assert len(ids) == 1000
    parsed = parse_kv_id(next(iter(ids)))
    assert len(parsed.random_hex) == 32 and parsed.model_version == "m-1"
    assert parsed.created_at_ms == 1_700_000_000_000


async def test_tensors_roundtrip_records_codec_in_layout(kv_server_factory, kv_client_cfg) -> None:
    _, target = await kv_server_factory()
    tensors = [torch.randn(2, 8, 16, 32, dtype=torch.bfloat16) for _ in range(4)]
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(tensors, codec="raw", model_version="tiny")
        obj = await kv.get(kv_id)
    assert obj.layout.codec == "raw" and obj.layout.num_layers == 2
    assert obj.layout.roles == ["key", "value", "key", "value"]
    assert obj.layout.shapes == [[2, 8, 16, 32]] * 4
    for a, b in zip(tensors, obj.tensors(), strict=True):
        assert torch.equal(a, b)


async def test_unknown_id_is_not_found_and_audited(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory()
    ghost = new_kv_id("m", 1_700_000_000_000)
    async with KVClient(target, kv_client_cfg()) as kv:
        with pytest.raises(KVError) as err:
            await kv.get(ghost)
        with pytest.raises(KVError) as bad:
            await kv.get("not-an-id")
    assert err.value.code is KVErrorCode.KV_NOT_FOUND and err.value.retries == 0
    assert bad.value.code is KVErrorCode.KV_INVALID
    recs = read_audit(server.service.cfg.audit_path)
    assert any(
        r["event"] == "get" and r["kv_id"] == ghost and r["outcome"] == "KV_NOT_FOUND" for r in recs
    )


async def test_release_then_get_is_not_found(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory()
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(b"x" * 100_000)
        await kv.get(kv_id)
        assert await kv.release(kv_id) == 100_000
        with pytest.raises(KVError) as err:
            await kv.get(kv_id)
    assert err.value.code is KVErrorCode.KV_NOT_FOUND
    assert server.store.used_bytes == 0
    rel = server.audit.records(event="release", kv_id=kv_id)
    assert rel[0]["reason"] == "released" and len(rel[0]["object_digest"]) == 16
    assert server.audit.records(event="get", kv_id=kv_id, outcome="KV_NOT_FOUND")


async def test_ttl_passes_then_expired_and_deleted(
    kv_server_factory, kv_client_cfg, kv_clock
) -> None:
    server, target = await kv_server_factory(clock=kv_clock)
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(b"y" * 70_000, ttl_s=60)
        kv_clock.advance(59.0)
        await kv.get(kv_id)  # still alive
        kv_clock.advance(1.5)
        with pytest.raises(KVError) as err:
            await kv.get(kv_id)
        with pytest.raises(KVError) as again:
            await kv.stat(kv_id)
    assert err.value.code is KVErrorCode.KV_EXPIRED and again.value.code is KVErrorCode.KV_EXPIRED
    assert server.store.used_bytes == 0
    exp = server.audit.records(event="expire", kv_id=kv_id)
    assert exp and exp[0]["reason"] == "expired" and exp[0]["bytes"] == 70_000
    assert server.audit.records(event="get", kv_id=kv_id, outcome="KV_EXPIRED")
    assert server.metrics.value("pdx_kv_expired_total") == 1


async def test_sweeper_deletes_unread_kv_without_any_access(
    kv_server_factory, kv_client_cfg, kv_clock
) -> None:
    server, target = await kv_server_factory(clock=kv_clock, sweep_interval_s=0.02)
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(b"z" * 10_000)
    kv_clock.advance(121)
    for _ in range(200):  # poll: the sweeper runs every 20 ms
        if not server.store.used_bytes:
            break
        await asyncio.sleep(0.01)
    assert server.store.used_bytes == 0
    assert server.audit.records(event="expire", kv_id=kv_id)


async def test_lease_keeps_object_past_ttl_but_not_past_max(
    kv_server_factory, kv_client_cfg, kv_clock
) -> None:
    _, target = await kv_server_factory(clock=kv_clock, lease_s=20)
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(b"l" * 1000, ttl_s=60)
        for _ in range(14):  # heartbeat every 15 s for 210 s
            kv_clock.advance(15)
            await kv.renew(kv_id)
        await kv.get(kv_id)  # 210 s > TTL 60 s: alive thanks to the lease
        kv_clock.advance(95)  # 305 s: past the contract's maximum lifetime
        with pytest.raises(KVError) as err:
            await kv.renew(kv_id)
    assert err.value.code is KVErrorCode.KV_EXPIRED


async def test_ttl_outside_contract_is_rejected(kv_server_factory, kv_client_cfg) -> None:
    _, target = await kv_server_factory()
    async with KVClient(target, kv_client_cfg()) as kv:
        with pytest.raises(KVError) as err:
            await kv.put(b"t" * 100, ttl_s=30)
    assert err.value.code is KVErrorCode.KV_INVALID and "ttl_s 30" in str(err.value)


async def test_two_concurrent_gets_of_one_id_both_succeed(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(2_000_000)
    async with KVClient(target, kv_client_cfg()) as a, KVClient(target, kv_client_cfg()) as b:
        kv_id = await a.put(data)
        got = await asyncio.gather(a.get(kv_id), b.get(kv_id), a.get(kv_id))
    assert all(bytes(o.data) == data for o in got)
    assert len(server.audit.records(event="get", kv_id=kv_id, outcome="ok")) == 3


async def test_parallel_streams_and_connections_roundtrip(kv_server_factory, kv_client_cfg) -> None:
    _, target = await kv_server_factory()
    data = os.urandom(3_000_000)
    cfg = kv_client_cfg(streams=4, connections=2)
    async with KVClient(target, cfg) as kv:
        kv_id = await kv.put(data)
        obj = await kv.get(kv_id)
        empty = await kv.put(b"")
        nothing = await kv.get(empty)
    assert bytes(obj.data) == data and obj.info.num_chunks == 46
    assert bytes(nothing.data) == b""


async def test_flood_past_budget_evicts_lru_and_stays_bounded(
    kv_server_factory, kv_client_cfg
) -> None:
    budget = 2_000_000
    server, target = await kv_server_factory(budget_bytes=budget)
    async with KVClient(target, kv_client_cfg()) as kv:
        first = await kv.put(os.urandom(300_000))
        keep = await kv.put(os.urandom(300_000))
        await kv.renew(keep)  # leased: not evictable
        ids = []
        for _ in range(60):
            ids.append(await kv.put(os.urandom(300_000)))
            assert server.store.used_bytes <= budget
        await kv.get(keep)
        await kv.get(ids[-1])
        with pytest.raises(KVError) as err:
            await kv.get(first)
    assert err.value.code is KVErrorCode.KV_NOT_FOUND and "budget" in str(err.value)
    evicted = server.audit.records(event="evict")
    assert len(evicted) >= 50 and keep not in {r["kv_id"] for r in evicted}
    assert evicted[0]["kv_id"] == first  # least recently used goes first
    assert server.metrics.value("pdx_kv_evicted_total") == len(evicted)
    assert server.metrics.value("pdx_kv_store_bytes") == server.store.used_bytes


async def test_store_full_when_everything_is_leased(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory(budget_bytes=1_000_000)
    async with KVClient(target, kv_client_cfg()) as kv:
        for _ in range(3):
            await kv.renew(await kv.put(os.urandom(300_000)))
        with pytest.raises(KVError) as err:
            await kv.put(os.urandom(300_000))
    assert err.value.code is KVErrorCode.KV_STORE_FULL
    assert server.audit.records(event="put", outcome="KV_STORE_FULL")


async def test_health_service_reports_serving_then_not(kv_server_factory) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server, target = await kv_server_factory()
    async with grpc.aio.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="pdx.kv.v1.KVStore"))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await server.health.enter_graceful_shutdown()
        resp = await stub.Check(health_pb2.HealthCheckRequest(service="pdx.kv.v1.KVStore"))
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.mark.parametrize("codec", ["zstd", "int8-g64"])
async def test_registered_codecs_plug_in(codec: str, kv_server_factory, kv_client_cfg) -> None:
    _, target = await kv_server_factory()
    tensors = [torch.randn(1, 4, 64, 64, dtype=torch.bfloat16) for _ in range(2)]
    async with KVClient(target, kv_client_cfg()) as kv:
        obj = await kv.get(await kv.put(tensors, codec=codec, model_version="tiny"))
    assert obj.layout.codec == codec
    for a, b in zip(tensors, obj.tensors(), strict=True):
        assert b.shape == a.shape and b.dtype == a.dtype
        err = (a.float() - b.float()).abs().max().item()
        assert err == 0 if codec == "zstd" else err < 0.1 * a.float().abs().max().item()
