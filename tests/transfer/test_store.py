"""The store and chunk layer directly: checksums catch every flip, budget and lifetime rules."""

from __future__ import annotations

import os
import random
import secrets

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdx._proto import kv_transfer_pb2 as pb
from pdx.transfer.contract import KVError, KVErrorCode, KVStoreConfig, ManualClock
from pdx.transfer.store import KVStore
from pdx.transfer.wire import digest64, encode_chunk, parse_chunk

CHUNK = 64 * 1024


def _header(data: bytes, token: bytes = b"", ttl_s: int = 0) -> pb.PutHeader:
    import xxhash

    return pb.PutHeader(
        model_version="m",
        ttl_s=ttl_s,
        size_bytes=len(data),
        chunk_size_bytes=CHUNK,
        object_digest=xxhash.xxh3_64_intdigest(data),
        upload_token=token,
    )


def _put(store: KVStore, data: bytes, *, flip: tuple[int, int] | None = None) -> str:
    obj = store.begin_put(_header(data, secrets.token_bytes(16)), "test")
    for i in range(obj.num_chunks):
        part = data[i * CHUNK : (i + 1) * CHUNK]
        msg = encode_chunk(i, part, digest64(part))
        if flip is not None and flip[0] == i:
            buf = bytearray(msg)
            buf[flip[1] % len(buf)] ^= 1 << random.randrange(8)
            msg = bytes(buf)
        try:
            chunk = parse_chunk(msg)
        except ValueError as exc:
            raise KVError(KVErrorCode.KV_CORRUPT, str(exc), resume_chunk=i) from None
        if chunk.index != i:
            raise KVError(KVErrorCode.KV_CORRUPT, "index", resume_chunk=i)
        store.put_chunk(obj, chunk, msg)
    assert store.finish_put(obj) == 0
    return obj.kv_id


def test_random_bit_flips_in_chunk_buffers_are_all_detected() -> None:
    """1000 single-bit flips anywhere in an encoded chunk message: 0 undetected."""
    store = KVStore(KVStoreConfig())
    rng = random.Random(5)
    data = os.urandom(5 * CHUNK + 1234)
    undetected = 0
    for _ in range(1000):
        chunk_index = rng.randrange(6)
        try:
            _put(store, data, flip=(chunk_index, rng.randrange(CHUNK + 16)))
        except KVError as exc:
            assert exc.code is KVErrorCode.KV_CORRUPT and exc.resume_chunk == chunk_index
            continue
        undetected += 1
    assert undetected == 0
    assert store.used_bytes == 0 or len(store) == 0


def test_object_digest_catches_what_chunk_digests_cannot() -> None:
    """Chunks that are each valid but belong to another object: the object digest says no."""
    store = KVStore(KVStoreConfig())
    data, other = os.urandom(3 * CHUNK), os.urandom(3 * CHUNK)
    obj = store.begin_put(_header(data, secrets.token_bytes(16)), "t")
    for i in range(3):
        src = other if i == 1 else data
        part = src[i * CHUNK : (i + 1) * CHUNK]
        msg = encode_chunk(i, part, digest64(part))
        store.put_chunk(obj, parse_chunk(msg), msg)
    with pytest.raises(KVError) as err:
        store.finish_put(obj)
    assert err.value.code is KVErrorCode.KV_CORRUPT and store.used_bytes == 0
    assert store.audit.records(event="abandon", reason="corrupt")


@settings(max_examples=200, deadline=None)
@given(
    index=st.integers(0, 2**32 - 1), data=st.binary(max_size=3000), digest=st.integers(0, 2**64 - 1)
)
def test_hand_wire_coding_equals_protobuf_runtime(index: int, data: bytes, digest: int) -> None:
    msg = encode_chunk(index, data, digest)
    ref = pb.PutRequest(chunk=pb.Chunk(index=index, digest=digest, data=data)).SerializeToString()
    assert msg == ref
    assert pb.GetResponse.FromString(msg).chunk.data == data
    parsed = parse_chunk(ref)
    assert (parsed.index, parsed.digest, bytes(parsed.data)) == (index, digest, data)


def test_lru_order_follows_reads_and_skips_leased() -> None:
    clock = ManualClock()
    store = KVStore(KVStoreConfig(budget_bytes=3 * CHUNK), clock=clock)
    a, b, c = (_put(store, os.urandom(CHUNK)) for _ in range(3))
    store.lookup(b)  # LRU order now a, c, b
    store.renew(a, 20)  # a is leased (and renewing counts as use): order c, b, a
    d = _put(store, os.urandom(CHUNK))  # evicts c
    e = _put(store, os.urandom(CHUNK))  # evicts b, not the leased a
    assert {o for o in (a, b, c, d, e) if o in store._objects} == {a, d, e}
    clock.advance(21)  # lease over: a is the oldest again
    _put(store, os.urandom(CHUNK))
    assert a not in store._objects
    assert [r["kv_id"] for r in store.audit.records(event="evict")] == [c, b, a]


def test_abandoned_upload_is_freed_at_ttl() -> None:
    clock = ManualClock()
    store = KVStore(KVStoreConfig(), clock=clock)
    data = os.urandom(2 * CHUNK)
    store.begin_put(_header(data, secrets.token_bytes(16)), "t")  # never finished
    assert store.used_bytes == 2 * CHUNK
    clock.advance(121)
    assert store.sweep() == 1 and store.used_bytes == 0
    assert store.audit.records(event="abandon")[0]["reason"] == "upload not finished before TTL"


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("ttl_s", 301, "ttl_s 301"),
        ("chunk_size_bytes", 1024, "chunk_size_bytes 1024"),
        ("model_version", "bad version", "model_version"),
    ],
)
def test_bad_headers_are_kv_invalid(field: str, value: object, needle: str) -> None:
    store = KVStore(KVStoreConfig())
    h = _header(b"x" * 10)
    setattr(h, field, value)
    with pytest.raises(KVError) as err:
        store.begin_put(h, "t")
    assert err.value.code is KVErrorCode.KV_INVALID and needle in str(err.value)


def test_upload_announcing_a_trailer_resumes_with_the_digest_in_the_header() -> None:
    store = KVStore(KVStoreConfig())
    data = os.urandom(4 * CHUNK + 10)
    token = secrets.token_bytes(16)
    first = _header(data, token)
    first.object_digest, first.digest_in_trailer = 0, True
    obj = store.begin_put(first, "test")
    for i in range(2):  # the first stream breaks after two chunks, before its trailer
        msg = encode_chunk(i, data[i * CHUNK : (i + 1) * CHUNK])
        store.put_chunk(obj, parse_chunk(msg), msg)
    again = _header(data, token)
    again.digest_in_trailer = True
    with pytest.raises(KVError) as err:  # a rejoining stream must name the digest
        store.begin_put(again, "test")
    assert err.value.code is KVErrorCode.KV_INVALID
    resumed = _header(data, token)
    resumed.start_chunk = 2
    assert store.begin_put(resumed, "test") is obj and not obj.digest_pending
    for i in range(2, obj.num_chunks):
        msg = encode_chunk(i, data[i * CHUNK : (i + 1) * CHUNK])
        store.put_chunk(obj, parse_chunk(msg), msg)
    assert store.finish_put(obj) == 0
    assert b"".join(store.lookup(obj.kv_id).data) == data  # type: ignore[arg-type]
