"""Attacks on `pdx kv-serve` (rows H1-H6 and the store's part of L): each one against a real
store process, from 127.0.0.2, with a legitimate client on 127.0.0.1 served meanwhile.

Bounds asserted (the store's defaults unless a test says otherwise):
- receive memory is allocated as bytes arrive: 250 connections claiming 16 MiB (or 1 MiB
  request bodies never sent) grow the store's RSS by < 48 MiB (it was +4,000 MiB);
- the TLS handshake and HELLO share one total deadline (``handshake_timeout_s``), and a
  source address holds at most ``max_unauthenticated_per_peer`` untrusted connections;
- a Put that makes no progress for ``stall_timeout_s`` ends (KV_TIMEOUT) and frees its slot
  and reservation; no Put outlives ``max_request_timeout_ms`` whatever deadline it asks for;
- an abandoned upload's reservation is freed ``upload_resume_s`` after it stalled;
- a kv_id is checked (length, charset) before it is logged: audit records stay < 2 KiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import socket
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import grpc
import pytest
from attack import Flood, Server, dial, kv_store, median

from pdx._proto import kv_transfer_pb2 as pb
from pdx._proto import kv_transfer_pb2_grpc as pb_grpc
from pdx.tls import TLSConfig, init_certs
from pdx.transfer.client import KVClient
from pdx.transfer.contract import KVClientConfig, KVError, KVErrorCode
from pdx.transfer.dataplane.framing import FRAME, VERSION, Kind
from pdx.transfer.rpc import map_rpc_error
from pdx.transfer.wire import digest64

pytestmark = [pytest.mark.slow, pytest.mark.alone]

MIB = 1024 * 1024
CHUNK = 64 * 1024


def frame(kind: Kind, payload: bytes = b"", index: int = 0, digest: int = 0) -> bytes:
    return FRAME.pack(kind, index, digest, len(payload)) + payload


def hello(client_id: str = "mallory") -> bytes:
    return frame(Kind.HELLO, pb.DataHello(version=VERSION, client_id=client_id).SerializeToString())


def put_header(size: int, *, token: bytes = b"") -> pb.PutHeader:
    return pb.PutHeader(model_version="attack-v1", size_bytes=size, chunk_size_bytes=CHUNK,
                        upload_token=token, digest_in_trailer=not token)  # fmt: skip


def put_request(header: pb.PutHeader, timeout_ms: int = 2**32 - 1) -> bytes:
    return frame(
        Kind.REQUEST, pb.DataRequest(timeout_ms=timeout_ms, put=header).SerializeToString()
    )


def read_error(sock: socket.socket, timeout_s: float) -> tuple[str, str]:
    """The (code, message) of the ERROR frame the store answers on ``sock``."""
    sock.settimeout(timeout_s)
    buf = b""
    while len(buf) < FRAME.size:
        piece = sock.recv(FRAME.size - len(buf))
        if not piece:
            raise EOFError("closed without an ERROR frame")
        buf += piece
    kind, _, _, length = FRAME.unpack(buf)
    assert kind == Kind.ERROR, kind
    body = b""
    while len(body) < length:
        body += sock.recv(length - len(body))
    err = pb.DataError.FromString(body)
    return pb.KVErrorCode.Name(err.code), err.message


async def legit(
    store: Server, n: int, *, transport: Literal["auto", "grpc", "data"] = "data",
    size: int = 256 * 1024, tls: TLSConfig | None = None, client_id: str = "decode",
    timeout_ms: int = 10_000, pause_s: float = 0.0,
) -> tuple[int, list[float], list[str]]:  # fmt: skip
    """``n`` Put+Get round trips from 127.0.0.1: (successes, latencies s, error codes)."""
    cfg = KVClientConfig(transport=transport, kv_transfer_timeout_ms=timeout_ms,
                         client_id=client_id, chunk_size_kb=64)  # fmt: skip
    ok, latencies, errors = 0, [], []
    async with KVClient(store.target, cfg, tls=tls) as kv:
        for _ in range(n):
            data = os.urandom(size)
            t0 = time.monotonic()
            try:
                got = await kv.get(await kv.put(data))
                assert bytes(got.data) == data
                ok += 1
            except KVError as exc:
                errors.append(exc.code.value)
            latencies.append(time.monotonic() - t0)
            await asyncio.sleep(pause_s)
    return ok, latencies, errors


def client_hello() -> bytes:
    """The first flight of a real TLS client: what a trickling attacker sends byte by byte."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname="kv-store")
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    init_certs(d, hosts=["127.0.0.1"])
    return d


# --- H1: a length header alone allocates nothing ---------------------------------------------


async def test_h1_length_headers_without_bytes_allocate_nothing(tmp_path: Path) -> None:
    # Admission opened wide so that all 250 connections reach the framing code.
    wide = ["max_connections=1024", "max_unauthenticated=1024", "max_connections_per_peer=1024",
            "max_unauthenticated_per_peer=1024", "handshake_timeout_s=30"]  # fmt: skip
    with kv_store(tmp_path, *wide) as store:
        base = store.rss_mb()

        def attack() -> tuple[float, int]:
            socks, sent = [], 0
            for i in range(250):
                s = dial(store.data_port)
                if i % 3 == 0:  # a HELLO header claiming 16 MiB
                    msg = FRAME.pack(Kind.HELLO, 0, 0, 16 * MIB)
                elif i % 3 == 1:  # after HELLO, a request header claiming 16 MiB
                    msg = hello() + FRAME.pack(Kind.REQUEST, 0, 0, 16 * MIB)
                else:  # after HELLO, a request header claiming 1 MiB (allowed) and no body
                    msg = hello() + FRAME.pack(Kind.REQUEST, 0, 0, MIB - 1)
                s.sendall(msg)
                sent += len(msg)
                socks.append(s)
            time.sleep(1.5)
            peak = store.rss_mb()
            for s in socks:
                s.close()
            return peak, sent

        peak, sent = await asyncio.to_thread(attack)
        await asyncio.sleep(1.0)
        after = store.rss_mb()
        print(f"H1: {sent} B sent; RSS {base:.0f} -> {peak:.0f} MiB held, {after:.0f} after")
        assert peak - base < 48, (base, peak)
        assert after - base < 48, (base, after)
        ok, _, errors = await legit(store, 3)
        assert ok == 3, errors


# --- H2: TLS handshakes trickled a byte at a time ----------------------------------------------


async def test_h2_trickled_tls_handshakes_end_at_the_total_deadline(
    tmp_path: Path, certs: Path
) -> None:
    tls = TLSConfig(cert_dir=certs, name="decode")
    with kv_store(tmp_path, "handshake_timeout_s=2", tls_dir=certs) as store:
        # One address, 520 connections, one ClientHello byte each 0.5 s: it may hold only
        # max_unauthenticated_per_peer (8) of them, each for at most 2 s in total.
        with Flood(store.data_port, size=520, duration_s=9, trickle=client_hello(),
                   tick_s=0.5, rate_per_s=200) as flood:  # fmt: skip
            await asyncio.sleep(1.0)
            ok, lat, errors = await legit(store, 6, tls=tls, transport="data", pause_s=0.5)
        held = [t for t in flood.lifetimes if t > 0.5]
        print(f"H2 one source: legit {ok}/6 on the data plane, median {median(lat) * 1e3:.0f} ms;"
              f" {flood.dialled} dialled, longest held {max(held, default=0):.1f} s")  # fmt: skip
        assert ok == 6, errors
        assert held and max(held) < 2 + 1.5, sorted(held)[-5:]

        # Sixteen addresses fill the whole untrusted pool (64): the data plane refuses the
        # legitimate client too, which (transport auto) moves to gRPC and is served.
        sources = tuple(f"127.0.0.{i}" for i in range(10, 26))
        with Flood(store.data_port, size=520, duration_s=9, trickle=client_hello(),
                   tick_s=0.5, rate_per_s=200, sources=sources):  # fmt: skip
            await asyncio.sleep(1.0)
            ok, lat, errors = await legit(store, 6, tls=tls, transport="auto", pause_s=0.5)
        print(f"H2 sixteen sources: legit {ok}/6 (auto), median {median(lat) * 1e3:.0f} ms")
        assert ok == 6, errors


# --- H3: a re-dialling flood of 1-byte connections ---------------------------------------------


async def test_h3_redial_flood_leaves_legitimate_clients_served(tmp_path: Path) -> None:
    with kv_store(tmp_path) as store:
        with Flood(store.data_port, size=300, duration_s=15, rate_per_s=60, first=b"\x01",
                   tick_s=0.25) as flood:  # fmt: skip
            await asyncio.sleep(2.0)
            ok, lat, errors = await legit(store, 8, pause_s=0.5)
        print(f"H3: legit {ok}/8, median {median(lat) * 1e3:.0f} ms; attacker dialled "
              f"{flood.dialled}, peak {flood.peak_open} open")  # fmt: skip
        assert flood.dialled >= 300
        assert ok == 8, errors


# --- H4: stalled Puts hold no slot past the stall deadline -------------------------------------


async def test_h4_stalled_puts_end_at_the_stall_deadline_and_free_their_slots(
    tmp_path: Path,
) -> None:
    sets = ["stall_timeout_s=1.5", "max_inflight_kv=32", "max_request_timeout_ms=4000",
            "budget_bytes=200000000"]  # fmt: skip
    with kv_store(tmp_path, *sets) as store:

        def stall(n: int) -> list[socket.socket]:
            socks = []
            for _ in range(n):
                s = dial(store.data_port)
                s.sendall(hello() + put_request(put_header(4 * MIB)))  # header, no chunk
                socks.append(s)
            return socks

        t0 = time.monotonic()
        socks = await asyncio.to_thread(stall, 34)
        # The attacker's address may hold 24 of the 32 slots: a legitimate peer is served now.
        ok, lat, errors = await legit(store, 2)
        during = time.monotonic() - t0
        ends = await asyncio.gather(*(asyncio.to_thread(read_error, s, 10) for s in socks))
        ended = time.monotonic() - t0
        for s in socks:
            s.close()
        codes = {code for code, _ in ends}
        print(
            f"H4: legit {ok}/2 within {during:.1f} s of the stall (median "
            f"{median(lat) * 1e3:.0f} ms); 34 stalled Puts all ended by {ended:.1f} s: {codes}"
        )
        assert ok == 2 and during < 1.5, (errors, during)
        # KV_UNAVAILABLE: admission refused the connection outright (per-peer or handshake
        # pool full, as happens when a slow machine lets the attacker's dials pile up).
        refused = [msg for code, msg in ends if code == "KV_UNAVAILABLE"]
        assert all("refused the connection" in msg for msg in refused), refused
        assert codes <= {"KV_TIMEOUT", "KV_OVERLOADED", "KV_UNAVAILABLE"}
        assert "KV_TIMEOUT" in codes
        assert any("no progress" in msg for _, msg in ends)
        assert ended < 1.5 * 2 + 3
        # Slots and reservations are back: the whole budget's worth can be stored.
        ok, _, errors = await legit(store, 1, size=150 * MIB, timeout_ms=30_000)
        assert ok == 1, errors

        # A Put that trickles (progress, one chunk every 0.5 s) ends at the store's maximum
        # request deadline (4 s here), whatever deadline it asked for (2^32-1 ms).
        def trickle() -> tuple[str, float]:
            s = dial(store.data_port)
            s.sendall(hello() + put_request(put_header(200 * CHUNK)))
            start = time.monotonic()
            s.settimeout(0.5)
            part = os.urandom(CHUNK)
            for i in range(40):
                try:
                    s.sendall(frame(Kind.CHUNK, part, index=i, digest=digest64(part)))
                    if s.recv(1, socket.MSG_PEEK):
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
            code, _ = read_error(s, 5)
            s.close()
            return code, time.monotonic() - start

        code, took = await asyncio.to_thread(trickle)
        print(f"H4: a trickling Put asking 49.7 days ended after {took:.1f} s: {code}")
        assert code == "KV_TIMEOUT" and 3.0 < took < 7.0


async def test_h4_grpc_puts_without_a_deadline_end_at_the_stall_deadline(tmp_path: Path) -> None:
    with kv_store(tmp_path, "stall_timeout_s=1.5") as store:
        async with grpc.aio.insecure_channel(store.target) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            forever = asyncio.Event()

            async def stalled() -> KVError:
                async def messages() -> AsyncIterator[pb.PutRequest]:
                    yield pb.PutRequest(header=put_header(4 * MIB))
                    await forever.wait()

                try:
                    await stub.Put(messages())  # no deadline
                except grpc.aio.AioRpcError as exc:
                    return map_rpc_error(exc)
                raise AssertionError("a Put without chunks succeeded")

            t0 = time.monotonic()
            errors = await asyncio.wait_for(asyncio.gather(*(stalled() for _ in range(34))), 30)
            took = time.monotonic() - t0
            forever.set()
        codes = {e.code for e in errors}
        print(f"H4 gRPC: 34 Puts without a deadline all ended after {took:.1f} s: {codes}")
        assert codes <= {KVErrorCode.KV_TIMEOUT, KVErrorCode.KV_OVERLOADED}
        assert KVErrorCode.KV_TIMEOUT in codes and took < 1.5 * 2 + 4
        ok, _, errs = await legit(store, 2, transport="grpc")
        assert ok == 2, errs


# --- H5: huge kv_ids never reach memory or the audit file ---------------------------------------


async def test_h5_huge_kv_ids_are_refused_before_they_are_logged(tmp_path: Path) -> None:
    with kv_store(tmp_path) as store:
        base = store.rss_mb()
        audit = store.audit_path
        assert audit is not None
        size0 = audit.stat().st_size if audit.exists() else 0
        opts = [("grpc.max_send_message_length", 128 * MIB)]
        statuses: set[str] = set()
        async with grpc.aio.insecure_channel(store.target, options=opts) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            # 35 calls with a 60 MiB kv_id (as the attack did), then 35 that fit in a message.
            for i, kv_id in enumerate(["k" * (60 * MIB)] * 35 + ["k" * 100_000] * 35):
                try:
                    if i % 2:
                        await stub.Stat(pb.StatRequest(kv_id=kv_id), timeout=20)
                    else:
                        async for _ in stub.Get(pb.GetRequest(kv_id=kv_id), timeout=20):
                            pass
                except grpc.aio.AioRpcError as exc:
                    code = exc.code().name
                    statuses.add(
                        code if code != "INVALID_ARGUMENT" else map_rpc_error(exc).code.value
                    )

        def data_plane() -> str:
            with dial(store.data_port) as s:
                req = pb.DataRequest(timeout_ms=5000, get=pb.GetRequest(kv_id="k" * 900_000))
                s.sendall(hello() + frame(Kind.REQUEST, req.SerializeToString()))
                return read_error(s, 10)[0]

        data_code = await asyncio.to_thread(data_plane)
        await asyncio.sleep(0.5)
        grown = audit.stat().st_size - size0
        longest = max(len(line) for line in audit.read_text().splitlines())
        rss = store.rss_mb() - base
        print(
            f"H5: 70 gRPC calls with 60 MiB / 100 kB kv_ids and a 900 kB data-plane Get: "
            f"{sorted(statuses)}, {data_code}; audit +{grown} B (longest record {longest} B), "
            f"RSS +{rss:.0f} MiB"
        )
        # Past the store's message limit gRPC itself refuses (RESOURCE_EXHAUSTED); below it
        # the store does, before the id is audited, counted or kept.
        assert statuses == {"RESOURCE_EXHAUSTED", "KV_INVALID"}, statuses
        assert data_code == "KV_INVALID"
        assert grown < 71 * 2048 and longest < 2048
        assert rss < 256


# --- H6: a stalled upload with a token gives its reservation back ------------------------------


async def test_h6_stalled_upload_with_a_token_frees_its_reservation(tmp_path: Path) -> None:
    sets = [
        "budget_bytes=200000000",
        "stall_timeout_s=1",
        "upload_resume_s=2",
        "sweep_interval_s=0.25",
    ]
    with kv_store(tmp_path, *sets) as store:
        s = await asyncio.to_thread(dial, store.data_port)
        part = os.urandom(CHUNK)
        header = put_header(150 * 1000 * 1000, token=secrets.token_bytes(16))
        s.sendall(hello() + put_request(header, timeout_ms=60_000)
                  + frame(Kind.CHUNK, part, 0, digest64(part)))  # fmt: skip
        t0 = time.monotonic()
        await asyncio.sleep(0.3)
        # The 150 MB reservation is real: 60 MB more does not fit a 200 MB budget.
        cfg = KVClientConfig(transport="data", kv_transfer_timeout_ms=20_000, kv_retry_budget=0)
        blob = os.urandom(60 * 1000 * 1000)
        async with KVClient(store.target, cfg) as kv:
            with pytest.raises(KVError) as full:
                await kv.put(blob)
            assert full.value.code is KVErrorCode.KV_STORE_FULL
            code, message = await asyncio.to_thread(read_error, s, 5)
            s.close()
            stalled_at = time.monotonic() - t0
            freed_at = None
            while time.monotonic() - t0 < 12:
                try:
                    await kv.put(blob)
                    freed_at = time.monotonic() - t0
                    break
                except KVError as exc:
                    assert exc.code is KVErrorCode.KV_STORE_FULL
                    await asyncio.sleep(0.25)
        print(
            f"H6: stalled upload ended at {stalled_at:.1f} s ({code}: {message}); its "
            f"reservation freed, a 60 MB Put stored at {freed_at or 0:.1f} s "
            "(was: TTL, up to 300 s)"
        )
        assert code == "KV_TIMEOUT"
        assert freed_at is not None and freed_at < 1 + 2 + 3
        assert store.audit_path is not None
        records = [json.loads(x) for x in store.audit_path.read_text().splitlines()]
        assert any("not resumed within 2 s" in str(r.get("reason", "")) for r in records), records[
            -5:
        ]


# --- L: garbage payloads, cancelled Puts, other identities -------------------------------------


async def test_l_garbage_protobuf_is_kv_invalid_without_tracebacks(tmp_path: Path) -> None:
    with kv_store(tmp_path) as store:
        async with grpc.aio.insecure_channel(store.target) as channel:
            put = channel.stream_unary("/pdx.kv.v1.KVStore/Put", request_serializer=None,
                                       response_deserializer=pb.PutResponse.FromString)  # fmt: skip

            async def garbage() -> AsyncIterator[bytes]:
                yield b"\xff\xff\xff\xff\x0f"

            with pytest.raises(grpc.aio.AioRpcError) as exc:
                await put(garbage(), timeout=10)
            assert map_rpc_error(exc.value).code is KVErrorCode.KV_INVALID

        def data_plane() -> set[str]:
            codes = set()
            for _ in range(50):
                with dial(store.data_port) as s:
                    s.sendall(hello() + frame(Kind.REQUEST, b"\xff\xff\xff\xff\x0f"))
                    codes.add(read_error(s, 10)[0])
            return codes

        assert await asyncio.to_thread(data_plane) == {"KV_INVALID"}
        ok, _, errors = await legit(store, 1)
        assert ok == 1, errors
        stderr = store.stderr()
        print(
            f"L: 51 garbage payloads -> KV_INVALID; store stderr {len(stderr.splitlines())} lines"
        )
        assert "Traceback" not in stderr
        assert len(stderr.splitlines()) <= 12, stderr


async def test_l_a_cancelled_put_is_audited_as_cancelled(tmp_path: Path) -> None:
    with kv_store(tmp_path) as store:
        async with grpc.aio.insecure_channel(store.target) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            sent = asyncio.Event()

            async def messages() -> AsyncIterator[pb.PutRequest]:
                yield pb.PutRequest(header=put_header(4 * MIB))
                part = os.urandom(CHUNK)
                yield pb.PutRequest(chunk=pb.Chunk(index=0, data=part, digest=digest64(part)))
                sent.set()
                await asyncio.sleep(30)

            call = stub.Put(messages(), timeout=20)
            await asyncio.wait_for(sent.wait(), 10)
            await asyncio.sleep(0.3)
            call.cancel()
            await asyncio.sleep(0.5)  # the channel stays open: the store sees the cancellation
        audit = store.audit_path
        assert audit is not None
        outcome = None
        for _ in range(40):
            puts = [json.loads(x) for x in audit.read_text().splitlines() if '"put"' in x]
            if puts:
                outcome = puts[-1]["outcome"]
                break
            await asyncio.sleep(0.1)
        assert outcome == "cancelled", audit.read_text()


async def test_l_only_the_writer_and_readers_may_get_or_release(tmp_path: Path) -> None:
    with kv_store(tmp_path) as store:

        async def as_(client_id: str) -> KVClient:
            cfg = KVClientConfig(transport="data", client_id=client_id, kv_retry_budget=0,
                                 kv_transfer_timeout_ms=5000)  # fmt: skip
            return KVClient(store.target, cfg)

        async with await as_("prefill") as prefill, await as_("mallory") as mallory:
            kv_id = await prefill.put(b"x" * 100_000)
            for attempt in (mallory.get(kv_id), mallory.release(kv_id), mallory.stat(kv_id)):
                with pytest.raises(KVError) as refused:
                    await attempt
                assert refused.value.code is KVErrorCode.KV_UNAUTHENTICATED
                assert "client=mallory" in refused.value.message
            async with await as_("decode") as decode:
                assert bytes((await decode.get(kv_id)).data) == b"x" * 100_000
                await decode.release(kv_id)
        assert store.audit_path is not None
        records = [json.loads(x) for x in store.audit_path.read_text().splitlines()]
        refusals = [r for r in records if r.get("who") == "client=mallory"]
        assert len(refusals) == 3 and {r["outcome"] for r in refusals} == {"KV_UNAUTHENTICATED"}
