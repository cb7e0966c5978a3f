"""The bulk data plane: discovery, fallbacks, TLS identity, framing errors, deadlines, pooling."""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import struct
import time

import pytest

from pdx._proto import kv_transfer_pb2 as pb
from pdx.tls import TLSConfig, client_ssl_context, init_certs
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVClientConfig, KVError, KVErrorCode
from pdx.transfer.dataplane.framing import FRAME, VERSION, BufferPool, Kind


def _cfg(**kw) -> KVClientConfig:
    kw.setdefault("kv_transfer_timeout_ms", 5000)
    kw.setdefault("chunk_size_kb", 64)
    return KVClientConfig(**kw)


def _frame(kind: Kind, payload: bytes = b"") -> bytes:
    return FRAME.pack(kind, 0, 0, len(payload)) + payload


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> object:
    d = tmp_path_factory.mktemp("certs")
    init_certs(d)
    return d


async def test_store_announces_its_data_plane_and_client_uses_it(kv_server_factory) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(700_000)
    async with KVClient(target, _cfg(streams=3)) as kv:
        ep = await kv.data_endpoint()
        kv_id = await kv.put(data)
        obj = await kv.get(kv_id)
    assert ep is not None and ep.port == server.service.data_server.port and ep.ssl_context is None
    assert bytes(obj.data) == data and len(obj.chunks) == 11
    puts = server.audit.records(event="put", kv_id=kv_id)
    assert len(puts) == 3 and {p["transport"] for p in puts} == {"data"}  # 3 streams
    # counted before the last chunk left: exact as soon as the client has its bytes
    assert server.metrics.value("pdx_kv_bytes_total", op="get", side="store") == len(data)


async def test_connections_are_pooled_across_requests(kv_server_factory) -> None:
    server, target = await kv_server_factory()
    async with KVClient(target, _cfg()) as kv:
        ids = [await kv.put(os.urandom(100_000)) for _ in range(3)]
        for kv_id in ids:
            await kv.get(kv_id)
    peers = {r["peer"] for r in server.audit.records() if r.get("transport") == "data"}
    assert len(peers) == 1  # six transfers, one TCP connection


async def test_store_without_data_plane_auto_falls_back_data_refuses(kv_server_factory) -> None:
    server, target = await kv_server_factory(data_plane=False)
    async with KVClient(target, _cfg()) as auto:
        assert await auto.data_endpoint() is None
        kv_id = await auto.put(b"x" * 1000)
    assert server.audit.records(event="put", kv_id=kv_id)[0].get("transport") is None
    async with KVClient(target, _cfg(transport="data")) as strict:
        with pytest.raises(KVError) as err:
            await strict.get(kv_id)
    assert err.value.code is KVErrorCode.KV_UNAVAILABLE
    assert "data_plane: false" in err.value.message


async def test_tls_client_refuses_a_plaintext_data_plane(certs, kv_server_factory) -> None:
    """A client with a TLS identity never sends KV in clear text, even if offered."""
    _, target = await kv_server_factory()
    tls = TLSConfig(cert_dir=certs, name="decode")
    async with KVClient(target, _cfg(transport="data"), data_ssl=client_ssl_context(tls)) as kv:
        with pytest.raises(KVError) as err:
            await kv.put(b"secret")
    assert err.value.code is KVErrorCode.KV_UNAVAILABLE and "plaintext" in err.value.message


async def test_data_plane_is_mutual_tls13_with_certificate_identity(
    certs, kv_server_factory
) -> None:
    server, target = await kv_server_factory(tls=TLSConfig(cert_dir=certs, name="kv-store"))
    data = os.urandom(300_000)
    async with KVClient(
        target, _cfg(transport="data"), tls=TLSConfig(cert_dir=certs, name="decode")
    ) as kv:
        ep = await kv.data_endpoint()
        kv_id = await kv.put(data)
        assert bytes((await kv.get(kv_id)).data) == data
    assert ep is not None and ep.ssl_context is not None
    get = server.audit.records(event="get", kv_id=kv_id)[0]
    assert get["who"] == "cn=decode" and get["transport"] == "data"
    # The data plane itself refuses anything older than TLS 1.3.
    import ssl

    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    ctx.maximum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certs / "decode.pem", certs / "decode.key")

    def old_handshake() -> None:
        port = server.service.data_server.port
        with (
            socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
            ctx.wrap_socket(raw, server_hostname="localhost"),
        ):
            pass

    with pytest.raises(ssl.SSLError):
        await asyncio.to_thread(old_handshake)


async def test_data_plane_rejects_a_client_without_certificate_and_audits_it(
    certs, kv_server_factory, kv_audit
) -> None:
    server, target = await kv_server_factory(tls=TLSConfig(cert_dir=certs, name="kv-store"))
    async with KVClient(
        target,
        _cfg(transport="data", kv_retry_budget=0, kv_transfer_timeout_ms=3000),
        tls=TLSConfig(cert_dir=certs, name="decode"),  # gRPC control calls are allowed ...
        data_ssl=client_ssl_context(None, cert_dir=certs),  # ... the data socket has no cert
        audit=kv_audit,
    ) as kv:
        with pytest.raises(KVError) as err:
            await kv.put(b"secret" * 1000)
    assert err.value.code in (KVErrorCode.KV_UNAUTHENTICATED, KVErrorCode.KV_UNAVAILABLE)
    assert len(server.store) == 0 and not server.audit.records(event="put")
    for _ in range(100):  # the store's record is written on its loop
        if server.audit.records(event="connect"):
            break
        await asyncio.sleep(0.02)
    rec = server.audit.records(event="connect")[0]
    assert rec["outcome"] == "KV_UNAUTHENTICATED" and rec["transport"] == "data"
    assert "certificate" in rec["reason"].lower()
    assert kv_audit.records(event="put", side="client", outcome=err.value.code.value)


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _read_frame(s: socket.socket) -> tuple[int, bytes]:
    head = b""
    while len(head) < FRAME.size:
        part = s.recv(FRAME.size - len(head))
        if not part:
            raise EOFError
        head += part
    kind, _, _, length = FRAME.unpack(head)
    body = b""
    while len(body) < length:
        body += s.recv(length - len(body))
    return kind, body


async def test_garbage_and_wrong_version_are_refused_and_the_store_lives_on(
    kv_server_factory,
) -> None:
    server, target = await kv_server_factory()
    port = server.service.data_server.port

    def poke() -> tuple[bytes, int, bytes]:
        with _raw(port) as s:  # not a frame at all: the store just closes
            s.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"\0" * 64)
            try:
                closed = s.recv(100)
            except ConnectionResetError:  # closed with our bytes unread
                closed = b""
        with _raw(port) as s:
            hello = pb.DataHello(version="pdx.kv.v0", client_id="old").SerializeToString()
            s.sendall(_frame(Kind.HELLO, hello))
            kind, body = _read_frame(s)
        return closed, kind, body

    closed, kind, body = await asyncio.to_thread(poke)
    assert closed == b"" and kind == Kind.ERROR
    err = pb.DataError.FromString(body)
    assert pb.KVErrorCode.Name(err.code) == "KV_INVALID" and VERSION in err.message
    rejects = server.audit.records(event="connect")
    assert {r["outcome"] for r in rejects} == {"KV_INVALID"}
    async with KVClient(target, _cfg(transport="data")) as kv:  # still serving
        assert len((await kv.get(await kv.put(b"ok" * 10))).data) == 20


async def test_stalled_uploader_loses_its_slot_at_its_deadline(kv_server_factory) -> None:
    """A client that announces a Put and goes silent holds nothing past its deadline."""
    server, _ = await kv_server_factory(max_inflight_kv=1)
    port = server.service.data_server.port
    header = pb.PutHeader(model_version="m", size_bytes=200_000, chunk_size_bytes=65536)
    request = pb.DataRequest(timeout_ms=300, put=header)

    def stall() -> tuple[float, int, bytes]:
        with _raw(port) as s:
            s.sendall(_frame(Kind.HELLO, pb.DataHello(version=VERSION).SerializeToString()))
            s.sendall(_frame(Kind.REQUEST, request.SerializeToString()))
            t0 = time.monotonic()
            kind, body = _read_frame(s)  # the store gives up on us, says why, and closes
            return time.monotonic() - t0, kind, body

    elapsed, kind, body = await asyncio.to_thread(stall)
    assert kind == Kind.ERROR and pb.KVErrorCode.Name(pb.DataError.FromString(body).code) in (
        "KV_TIMEOUT"
    )
    assert elapsed < 0.3 + 1.5  # deadline + the store's grace, on a busy box
    for _ in range(100):
        if server.metrics.value("pdx_kv_inflight", side="store") == 0:
            break
        await asyncio.sleep(0.02)
    assert server.metrics.value("pdx_kv_inflight", side="store") == 0
    assert server.audit.records(event="put", outcome="KV_TIMEOUT")
    assert server.store.used_bytes == 0  # the half upload was dropped from the budget


async def test_store_stop_ends_open_connections_promptly(kv_server_factory) -> None:
    server, target = await kv_server_factory()
    async with KVClient(target, _cfg()) as kv:
        await kv.get(await kv.put(b"x" * 100_000))  # leaves a pooled connection open
        t0 = time.monotonic()
        await server.stop(0.2)
        assert time.monotonic() - t0 < 2.0
        with pytest.raises(KVError) as err:
            await kv.stat("kv1." + "0" * 32 + ".1.m")
    assert err.value.code in (KVErrorCode.KV_UNAVAILABLE, KVErrorCode.RETRY_BUDGET_EXHAUSTED)


async def test_a_pooled_connection_the_store_closed_is_replaced(kv_server_factory, monkeypatch):
    import pdx.transfer.dataplane.server as data_server

    monkeypatch.setattr(data_server, "IDLE_TIMEOUT_S", 0.2)
    _, target = await kv_server_factory()
    async with KVClient(target, _cfg(kv_retry_budget=0)) as kv:
        kv_id = await kv.put(b"x" * 100_000)
        await asyncio.sleep(0.6)  # the store closes the idle connection
        obj = await kv.get(kv_id)
    assert len(obj.data) == 100_000 and kv.records()[-1].retries == 0


def test_buffer_pool_reuses_a_buffer_once_its_last_view_is_gone() -> None:
    pool = BufferPool(max_free_bytes=64 << 20)
    buf = pool.get(3 << 20)
    part = buf[100:200]
    del buf
    gc.collect()
    again = pool.get(3 << 20)
    assert pool.reused == 0  # `part` still pointed into the first buffer
    del part, again
    gc.collect()
    third = pool.get((3 << 20) - 5)
    assert pool.reused == 1 and len(third) == (3 << 20) - 5
    small = pool.get(1000)  # below the pool's floor: plain heap memory
    assert len(small) == 1000 and pool.allocated == 2


def test_frame_header_is_24_bytes_little_endian() -> None:
    raw = FRAME.pack(Kind.CHUNK, 7, 0x0102030405060708, 65536)
    assert len(raw) == 24
    assert raw[0] == 4 and raw[1:4] == b"\0\0\0"
    assert struct.unpack_from("<I", raw, 4)[0] == 7
    assert struct.unpack_from("<Q", raw, 8)[0] == 0x0102030405060708
    assert struct.unpack_from("<Q", raw, 16)[0] == 65536


@pytest.mark.parametrize(("writer", "reader"), [("data", "grpc"), ("grpc", "data")])
async def test_an_object_written_on_one_transport_reads_on_the_other(
    kv_server_factory, writer: str, reader: str
) -> None:
    server, target = await kv_server_factory()
    data = os.urandom(333_333)
    async with KVClient(target, _cfg(transport=writer)) as w:
        kv_id = await w.put(data)
    async with KVClient(target, _cfg(transport=reader)) as r:
        first, second = await r.get(kv_id), await r.get(kv_id)
    assert bytes(first.data) == bytes(second.data) == data
    obj = server.store.lookup(kv_id)
    if writer == "data":  # gRPC reads build messages on the fly and keep none
        assert obj.messages == [None] * obj.num_chunks


async def test_a_handoff_the_thread_gave_up_on_never_waits_forever() -> None:
    from pdx.transfer.dataplane.handoff import Handoff

    loop = asyncio.get_running_loop()
    late = Handoff(loop)
    late.abandon(KVError(KVErrorCode.KV_TIMEOUT, "gave up"))
    await asyncio.sleep(0)  # the mark runs on the loop
    with pytest.raises(KVError):
        await asyncio.wait_for(late.exchange("object"), 1)
    waiting = Handoff(loop)
    task = asyncio.create_task(waiting.exchange("object"))
    await asyncio.sleep(0.01)
    assert waiting.given.result() == "object"
    waiting.abandon(KVError(KVErrorCode.KV_TIMEOUT, "gave up"))
    with pytest.raises(KVError):
        await asyncio.wait_for(task, 1)


async def test_a_request_queued_past_its_deadline_leaves_no_slot_behind(
    kv_server_factory,
) -> None:
    from test_kv_faults import _hold_slot, _until_inflight

    server, target = await kv_server_factory(max_inflight_kv=1, inflight_wait_ms=3000)
    async with KVClient(target, _cfg(transport="data")) as kv:
        kv_id = await kv.put(os.urandom(100_000))
    gate = asyncio.Event()
    hog = asyncio.create_task(_hold_slot(target, lambda **kw: _cfg(**kw), gate))
    await _until_inflight(server, 1)
    async with KVClient(target, _cfg(transport="data", kv_transfer_timeout_ms=300)) as kv:
        with pytest.raises(KVError) as err:
            await kv.get(kv_id)
    assert err.value.code in (
        KVErrorCode.KV_TIMEOUT,
        KVErrorCode.KV_OVERLOADED,
        KVErrorCode.RETRY_BUDGET_EXHAUSTED,
    )
    hog.cancel()
    await asyncio.gather(hog, return_exceptions=True)
    await _until_inflight(server, 0)
    async with KVClient(target, _cfg(transport="data")) as kv:
        assert len((await kv.get(kv_id)).data) == 100_000


async def _move_data_plane(server) -> int:
    """Restart the store's data plane on another port (as a restarted store would be)."""
    from pdx.transfer.server import _data_server

    old = server.service.data_server
    await asyncio.to_thread(old.stop, 0.5)
    new = _data_server(server.service, server.service.cfg)
    new.start()
    server.service.data_server = new
    return old.port


async def test_after_the_data_port_moves_a_data_client_asks_again(kv_server_factory) -> None:
    server, target = await kv_server_factory()
    async with KVClient(target, _cfg(transport="data")) as kv:
        kv_id = await kv.put(os.urandom(200_000))
        old_port = await _move_data_plane(server)
        obj = await kv.get(kv_id)  # the cached port refuses; the retry asks DataPlane again
        ep = await kv.data_endpoint()
    assert len(obj.data) == 200_000 and kv.records()[-1].retries == 1
    assert ep is not None and ep.port == server.service.data_server.port != old_port


async def test_auto_uses_grpc_when_the_data_port_does_not_answer(kv_server_factory) -> None:
    server, target = await kv_server_factory()
    with socket.socket() as s:  # a port with nothing listening (a firewall would look alike)
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    data = os.urandom(200_000)
    cfg = _cfg(kv_retry_budget=0, data_target=f"127.0.0.1:{dead}")
    async with KVClient(target, cfg, audit=None) as kv:
        kv_id = await kv.put(data)
        obj = await kv.get(kv_id)
        assert await kv.data_endpoint() is None  # for a while, then it tries again
    assert bytes(obj.data) == data and [r.retries for r in kv.records()] == [0, 0]
    assert [r.get("transport") for r in server.audit.records(kv_id=kv_id)] == [None, None]
    assert [r["transport"] for r in kv.audit.records(side="client")] == ["grpc", "grpc"]


@pytest.mark.parametrize("streams", [1, 4])
async def test_gets_are_paced_to_the_stores_cap_however_many_run(kv_server_factory, streams):
    """max_get_gbps caps what the store's Gets send, split across the Gets sending at once:
    one Get and two at once move at most the cap (kernel pacing, SO_MAX_PACING_RATE); an
    unpaced store on the same loopback moves far more, so the cap is what is measured."""
    cap_gbps = 0.4
    # 24 MiB: loopback's 64 KB segments let each new connection's first window (~640 KB)
    # leave before pacing spaces it, a few % of this and negligible at a WAN's 1,500 bytes
    data = os.urandom(24 << 20)

    async def rates(target: str) -> tuple[float, float]:
        async with KVClient(target, _cfg(streams=streams, chunk_size_kb=1024,
                                         kv_transfer_timeout_ms=60_000)) as kv:  # fmt: skip
            kv_id = await kv.put(data)
            start = time.perf_counter()
            await kv.get(kv_id)
            one = len(data) * 8 / (time.perf_counter() - start) / 1e9
            start = time.perf_counter()
            await asyncio.gather(kv.get(kv_id), kv.get(kv_id))
            two = 2 * len(data) * 8 / (time.perf_counter() - start) / 1e9
            return one, two

    server, target = await kv_server_factory(max_get_gbps=cap_gbps, budget_bytes=1 << 28)
    one, two = await rates(target)
    assert 0.5 * cap_gbps <= one <= 1.1 * cap_gbps, one
    assert 0.5 * cap_gbps <= two <= 1.1 * cap_gbps, two
    assert server.service.metrics.value("pdx_kv_link_cap_bits_per_second") == cap_gbps * 1e9
    assert server.service.metrics.value("pdx_kv_paced_connections") == 0  # all ended
    _, free = await kv_server_factory(budget_bytes=1 << 28)
    assert min(await rates(free)) > 2 * cap_gbps
