"""Decode's early rebuild of a streamed object: raw tensors decoded as their bytes arrive."""

from __future__ import annotations

import pytest
import torch

from pdx.errors import InputError
from pdx.serving.backends import BackendConfig, create_backend
from pdx.serving.backends.kvwire import StreamRebuild, encode_kv


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    backend = create_backend(BackendConfig())
    state, _ = backend.prefill([5 + i % 200 for i in range(37)])
    return backend, state


@pytest.mark.parametrize("piece", [777, 4096, 1 << 20])
@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
def test_rebuild_as_bytes_arrive_equals_the_state(tiny, piece: int, codec: str) -> None:  # type: ignore[no-untyped-def]
    backend, state = tiny
    enc = encode_kv(state, codec, len(state.tensors) // 2)
    payload = memoryview(enc.payload)
    rebuild = StreamRebuild(codec)
    for a in range(0, len(payload), piece):
        rebuild.feed(payload[a : a + piece])
    # raw: every tensor was rebuilt before the object was complete; others at the end
    assert len(rebuild.tensors) == (len(state.tensors) if codec == "raw" else 0)
    got = rebuild.finish(lambda: payload, len(payload), enc.layout, backend, state.length)
    assert all(torch.equal(a, b) for a, b in zip(got.tensors, state.tensors, strict=True))


def test_rebuild_checks_the_closed_layout(tiny) -> None:  # type: ignore[no-untyped-def]
    backend, state = tiny
    enc = encode_kv(state, "raw", len(state.tensors) // 2)
    payload = memoryview(enc.payload)
    rebuild = StreamRebuild("raw")
    rebuild.feed(payload)
    wrong = {**enc.layout, "tensor_bytes": [*enc.layout["tensor_bytes"][:-1], 1]}
    with pytest.raises(InputError):
        rebuild.finish(lambda: payload, len(payload), wrong, backend, state.length)
    garbage = StreamRebuild("raw")
    garbage.feed(memoryview(b"not a frame at all"))
    assert garbage.failed is not None  # falls back to the whole-object decode, which refuses
    with pytest.raises(InputError):
        garbage.finish(lambda: b"not a frame at all", 18, enc.layout, backend, state.length)


@pytest.mark.parametrize("backend_name", ["transformers", "synthetic"])
def test_layers_handed_over_during_the_pass_equal_the_plain_prefill(backend_name: str) -> None:
    import time

    cfg = BackendConfig(backend=backend_name, prefill_tflops=0.00005)  # synthetic: ~0.3 s
    backend = create_backend(cfg)
    prompt = [5 + i % 200 for i in range(80)]
    seen: list[tuple[float, list[torch.Tensor]]] = []
    t0 = time.perf_counter()
    state, logits = backend.prefill_layers(
        prompt, lambda ts, rs: seen.append((time.perf_counter(), ts))
    )
    done = time.perf_counter()
    plain, plain_logits = backend.prefill(prompt)
    assert torch.equal(logits, plain_logits)
    handed = [t for _, ts in seen for t in ts]
    assert len(handed) == len(state.tensors) == len(plain.tensors)
    assert all(torch.equal(a, b) for a, b in zip(handed, plain.tensors, strict=True))
    assert seen[0][0] < done  # the first layer came before the pass ended
    if backend_name == "synthetic":  # one roofline layer of time apart
        assert seen[0][0] - t0 < (done - t0) * 0.75
    assert backend.kv_bytes_bound(len(prompt))[0] == state.nbytes
