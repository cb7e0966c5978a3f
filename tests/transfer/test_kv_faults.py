"""Faults on the wire (pdx.faults proxy between client and store): corruption, stalls, budgets."""

from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest

from pdx.faults import Bandwidth, Corrupt, FaultProxy, Timeout
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVError, KVErrorCode
from pdx.transfer.retry import GlobalRetryBudget

# The corruption tests run over plaintext on purpose: under TLS a flipped byte breaks the
# record MAC and surfaces as a connection error, never as bad data.


def _host_port(target: str) -> tuple[str, int]:
    host, port = target.rsplit(":", 1)
    return host, int(port)


def _upstream(server, target: str, transport: str) -> tuple[str, int]:
    """What the fault proxy fronts: the data plane's port, or the gRPC port."""
    if transport == "data":
        return "127.0.0.1", server.service.data_server.port
    return _host_port(target)


def _via(proxy: FaultProxy, target: str, transport: str, cfg) -> KVClient:
    """A client whose bulk bytes cross ``proxy`` (control calls go direct on the data plane)."""
    if transport == "data":
        return KVClient(target, cfg.model_copy(update={"data_target": f"127.0.0.1:{proxy.port}"}))
    return KVClient(f"127.0.0.1:{proxy.port}", cfg)


async def test_flipped_byte_is_kv_corrupt_then_resumed_retry(
    kv_server_factory, kv_client_cfg, kv_transport
) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(2_000_000)  # 31 chunks of 64 KiB
    async with KVClient(target, kv_client_cfg()) as direct:
        kv_id = await direct.put(data)
    flip = Corrupt(name="flip", direction="downstream", offset=1_200_000, seed=7)
    upstream = _upstream(server, target, kv_transport)
    async with FaultProxy(("127.0.0.1", 0), upstream, toxics=[flip]) as proxy:
        async with _via(proxy, target, kv_transport, kv_client_cfg(kv_retry_budget=0)) as strict:
            with pytest.raises(KVError) as err:
                await strict.get(kv_id)
        assert err.value.code is KVErrorCode.KV_CORRUPT
        assert err.value.resume_chunk is not None and err.value.resume_chunk > 10
        proxy.remove_toxic("flip")
        proxy.add_toxic(Corrupt(name="flip2", direction="downstream", offset=1_200_000, seed=7))
        async with _via(proxy, target, kv_transport, kv_client_cfg(kv_retry_budget=2)) as kv:
            obj = await kv.get(kv_id)
    assert bytes(obj.data) == data
    rec = kv.records()[-1]
    assert rec.outcome == "ok" and rec.retries == 1
    assert kv.audit.records(event="get", side="client")[-1]["transport"] == kv_transport
    # Resumed at the chunk that failed in this transfer, not from zero. (Which chunk the byte
    # at stream offset 1.2 MB lands in differs between connections: HTTP/2 control frames
    # interleave differently, so the first connection's chunk is not compared.)
    assert rec.resumed_chunks > 10
    assert kv.metrics.value("pdx_kv_corrupt_chunks_total", side="client") == 1
    retry = kv.audit.records(event="retry", kv_id=kv_id)
    assert retry[0]["outcome"] == "KV_CORRUPT" and retry[0]["resume_chunk"] == rec.resumed_chunks
    assert strict.audit.records(event="get", side="client", outcome="KV_CORRUPT")
    gets = server.audit.records(event="get", kv_id=kv_id)
    assert [g["from_chunk"] for g in gets][-1] == rec.resumed_chunks


async def test_flipped_byte_on_put_is_caught_by_store_and_resumed(
    kv_server_factory, kv_client_cfg, kv_transport
) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(1_500_000)
    flip = Corrupt(name="flip", direction="upstream", offset=900_000, seed=3)
    upstream = _upstream(server, target, kv_transport)
    async with FaultProxy(("127.0.0.1", 0), upstream, toxics=[flip]) as proxy:  # noqa: SIM117 (port known only once started)
        async with _via(proxy, target, kv_transport, kv_client_cfg()) as kv:
            kv_id = await kv.put(data)
            obj = await kv.get(kv_id)
    assert bytes(obj.data) == data
    rec = kv.records()[0]
    assert rec.retries == 1 and rec.resumed_chunks > 5
    bad = server.audit.records(event="put", outcome="KV_CORRUPT")
    assert bad and "digest mismatch" in bad[0]["reason"]
    assert server.metrics.value("pdx_kv_corrupt_chunks_total", side="store") == 1


async def test_random_flips_are_never_silent(
    kv_server_factory, kv_client_cfg, kv_transport
) -> None:
    """N transfers, each with one byte flipped at a random offset: 0 undetected."""
    server, target = await kv_server_factory()
    upstream = _upstream(server, target, kv_transport)
    data = os.urandom(1_000_000)
    async with KVClient(target, kv_client_cfg()) as direct:
        kv_id = await direct.put(data)
    rng = __import__("random").Random(11)
    n, detected, silent = 50, 0, 0
    codes: dict[str, int] = {}
    for i in range(n):
        flip = Corrupt(
            name=f"f{i}", direction="downstream", offset=rng.randrange(200, 1_000_000), seed=i
        )
        async with FaultProxy(("127.0.0.1", 0), upstream, toxics=[flip]) as proxy:
            async with _via(proxy, target, kv_transport, kv_client_cfg(kv_retry_budget=0)) as kv:
                try:
                    obj = await kv.get(kv_id)
                except KVError as exc:
                    codes[exc.code.value] = codes.get(exc.code.value, 0) + 1
                    detected += 1  # KV_CORRUPT, or a broken HTTP/2 frame: an error, never bad data
                    continue
            assert proxy.stats() is not None
            silent += bytes(obj.data) != data
    print(f"{n} flipped transfers: {detected} detected {codes}, {silent} silent")
    assert silent == 0
    assert detected >= n - 3  # a flip can land in a frame the stack discards; it is then harmless


async def test_stalled_upstream_times_out_within_deadline(
    kv_server_factory, kv_client_cfg, kv_transport
) -> None:
    server, target = await kv_server_factory()
    async with KVClient(target, kv_client_cfg()) as direct:
        kv_id = await direct.put(os.urandom(500_000))
        warm = await direct.put(b"warm")
    async with (
        FaultProxy(("127.0.0.1", 0), _upstream(server, target, kv_transport)) as proxy,
        _via(proxy, target, kv_transport, kv_client_cfg(kv_transfer_timeout_ms=300)) as kv,
    ):
        await kv.get(warm)  # connection up, then the link goes silent
        proxy.add_toxic(Timeout(name="blackhole", direction="downstream"))
        t0 = time.monotonic()
        with pytest.raises(KVError) as err:
            await kv.get(kv_id)
        elapsed_ms = (time.monotonic() - t0) * 1000
    assert err.value.code is KVErrorCode.KV_TIMEOUT
    assert elapsed_ms < 300 + 500  # the deadline, plus scheduling slack on a busy box
    assert kv.records()[-1].outcome == "KV_TIMEOUT"
    assert kv.audit.records(event="get", outcome="KV_TIMEOUT")


async def test_stalled_put_times_out_within_deadline(
    kv_server_factory, kv_client_cfg, kv_transport
) -> None:
    server, target = await kv_server_factory()
    async with FaultProxy(("127.0.0.1", 0), _upstream(server, target, kv_transport)) as proxy:
        cfg = kv_client_cfg(kv_transfer_timeout_ms=300)
        async with _via(proxy, target, kv_transport, cfg) as kv:
            await kv.release(await kv.put(b"warm" * 100))
            proxy.add_toxic(Timeout(name="blackhole", direction="upstream"))
            t0 = time.monotonic()
            with pytest.raises(KVError) as err:
                await kv.put(os.urandom(2_000_000))
            elapsed_ms = (time.monotonic() - t0) * 1000
    assert err.value.code is KVErrorCode.KV_TIMEOUT and elapsed_ms < 300 + 500
    assert kv.audit.records(event="put", side="client", outcome="KV_TIMEOUT")


async def _hold_slot(target: str, kv_client_cfg, gate: asyncio.Event) -> None:
    """Open a Put that sends its header and then waits: it holds one transfer slot."""
    from pdx._proto import kv_transfer_pb2 as pb

    async with KVClient(target, kv_client_cfg(kv_transfer_timeout_ms=5000)) as c:
        call = c._rpc(0, "stream_unary", "Put")

        async def slow():
            head = pb.PutHeader(model_version="m", size_bytes=1, chunk_size_bytes=65536)
            yield pb.PutRequest(header=head).SerializeToString()
            await gate.wait()

        with pytest.raises(grpc.aio.AioRpcError):
            await call(slow(), timeout=5)


async def _until_inflight(server, n: int) -> None:
    for _ in range(300):
        if server.metrics.value("pdx_kv_inflight", side="store") == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("slot never taken")


async def test_backpressure_waits_for_a_slot(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory(max_inflight_kv=1, inflight_wait_ms=3000)
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(os.urandom(100_000))
        gate = asyncio.Event()
        hog = asyncio.create_task(_hold_slot(target, kv_client_cfg, gate))
        await _until_inflight(server, 1)
        waiting = asyncio.create_task(kv.get(kv_id))
        await asyncio.sleep(0.2)
        assert not waiting.done()  # queued behind the hog, not refused
        hog.cancel()
        await asyncio.gather(hog, return_exceptions=True)
        obj = await waiting
    assert len(obj.data) == 100_000 and kv.records()[-1].retries == 0


async def test_retry_budget_runs_out(kv_server_factory, kv_client_cfg) -> None:
    server, target = await kv_server_factory(max_inflight_kv=1, inflight_wait_ms=0)
    async with KVClient(target, kv_client_cfg()) as kv:
        kv_id = await kv.put(os.urandom(200_000))
    gate = asyncio.Event()
    hog = asyncio.create_task(_hold_slot(target, kv_client_cfg, gate))
    await _until_inflight(server, 1)
    async with KVClient(target, kv_client_cfg(kv_retry_budget=2)) as kv:
        with pytest.raises(KVError) as err:
            await kv.get(kv_id)
    hog.cancel()
    await asyncio.gather(hog, return_exceptions=True)
    assert err.value.code is KVErrorCode.RETRY_BUDGET_EXHAUSTED and err.value.retries == 2
    assert "KV_OVERLOADED" in str(err.value)
    assert len(server.audit.records(event="get", kv_id=kv_id, outcome="KV_OVERLOADED")) == 3
    assert kv.records()[-1].outcome == "RETRY_BUDGET_EXHAUSTED"
    assert kv.metrics.value("pdx_kv_retries_total", op="get") == 2
    assert len(kv.audit.records(event="retry", outcome="KV_OVERLOADED")) == 2


async def test_global_retry_budget_stops_a_storm(kv_server_factory, kv_client_cfg) -> None:
    """A dead store: many requests fail at once; the global budget allows few retries."""
    now = [0.0]
    budget = GlobalRetryBudget(ratio=0.1, min_per_s=0.0, window_s=10.0, clock=lambda: now[0])
    cfg = kv_client_cfg(kv_retry_budget=5, backoff_base_ms=1, backoff_max_ms=2)
    dead = "127.0.0.1:1"  # nothing listens on port 1 of loopback
    async with KVClient(dead, cfg, retry_budget=budget) as kv:
        results = await asyncio.gather(
            *(kv.stat("kv1." + "0" * 32 + ".1.m") for _ in range(20)), return_exceptions=True
        )
    codes = [r.code for r in results if isinstance(r, KVError)]
    assert len(codes) == 20 and set(codes) == {KVErrorCode.RETRY_BUDGET_EXHAUSTED}
    assert budget.retries_in_window <= 2  # 10 % of 20 requests, not 20 x 5


def test_global_budget_window_slides() -> None:
    now = [0.0]
    b = GlobalRetryBudget(ratio=0.5, min_per_s=0.0, window_s=10.0, clock=lambda: now[0])
    for _ in range(4):
        b.on_request()
    assert [b.try_retry() for _ in range(3)] == [True, True, False]
    now[0] = 11.0
    assert not b.try_retry()  # the requests left the window too
    b.on_request()
    b.on_request()
    assert b.try_retry()


@pytest.mark.parametrize("streams", [1, 4])
async def test_a_link_that_slows_for_good_is_learned_and_gets_succeed_again(
    kv_server_factory, kv_client_cfg, kv_transport, streams
) -> None:
    """The estimate learned only from successes: once the link slowed below what a derived
    deadline allows, every Get timed out and nothing could teach it the new rate."""
    server, target = await kv_server_factory()
    data = os.urandom(4_000_000)  # 62 chunks of 64 KiB
    async with KVClient(target, kv_client_cfg()) as direct:
        kv_id = await direct.put(data)
    upstream = _upstream(server, target, kv_transport)
    # With several streams the ranges time out together: one timeout, one retry, not one each.
    cfg = kv_client_cfg(kv_transfer_timeout_ms=None, kv_retry_budget=2, streams=streams)
    async with FaultProxy(("127.0.0.1", 0), upstream) as proxy:  # noqa: SIM117 (port known only once started)
        async with _via(proxy, target, kv_transport, cfg) as kv:
            for _ in range(2):  # warm: the estimate learns the loopback rate
                await kv.get(kv_id, size_hint=len(data))
            fast = kv.records()[-1]
            assert fast.outcome == "ok" and fast.deadline_ms < 1000
            # 40 Mbit/s in all: the rate is per proxied connection, and the data plane gives
            # each stream a connection of its own.
            per_conn = 40 / streams if kv_transport == "data" else 40
            proxy.add_toxic(Bandwidth(name="slow", direction="downstream", rate_mbps=per_conn))
            slowed = await kv.get(kv_id, size_hint=len(data))  # 0.8 s at 40 Mbit/s
            first = kv.records()[-1]
            learned = kv.path.goodput_bps
            again = await kv.get(kv_id, size_hint=len(data))
            second = kv.records()[-1]
            proxy.remove_toxic("slow")
            for _ in range(3):
                await kv.get(kv_id, size_hint=len(data))
            recovered = kv.path.goodput_bps
    assert bytes(slowed.data) == data and bytes(again.data) == data
    # It ran out of the deadline sized for loopback, learned the rate it got and was retried
    # under a deadline sized for it, from the chunk where it stopped.
    assert first.outcome == "ok" and first.retries == 1 and first.resumed_chunks > 0
    assert first.deadline_ms > 1000
    assert learned is not None and learned < 60e6
    retry = kv.audit.records(event="retry", kv_id=kv_id)
    assert retry[-1]["outcome"] == "KV_TIMEOUT"
    # The next Get is sized for the slow link from its start: no timeout, no retry.
    assert second.outcome == "ok" and second.retries == 0 and second.deadline_ms > 1000
    # Successes at the loopback rate raise the estimate again.
    assert recovered is not None and recovered > 4 * learned
