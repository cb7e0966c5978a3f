"""Model backends: deterministic tiny models, real KV, wire round trips, synthetic sizes."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdx.errors import InputError
from pdx.serving.backends import BackendConfig, backend_names, create_backend
from pdx.serving.backends.kvwire import decode_kv, encode_kv
from pdx.serving.backends.sampling import pick_token
from pdx.serving.backends.synthetic import synthetic_spec
from pdx.serving.backends.tokenizer import ByteTokenizer

PROMPT = [10, 20, 30, 40, 50, 60, 70, 80, 90]


@pytest.fixture(scope="module")
def tiny():  # type: ignore[no-untyped-def]
    return create_backend(BackendConfig())


def greedy(backend, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    state, logits = backend.prefill(prompt)
    tokens = [pick_token(logits, 0, 0, len(prompt))]
    while len(tokens) < n:
        (state,), logits = backend.decode_step([state], [tokens[-1]])
        tokens.append(pick_token(logits[0], 0, 0, 0))
    return tokens


def test_registry_lists_both_backends() -> None:
    assert {"transformers", "synthetic"} <= set(backend_names())


def test_a_registered_backend_can_be_chosen_from_config() -> None:
    from pdx.errors import ConfigError
    from pdx.serving.backends import ModelBackend, register_backend
    from pdx.serving.backends.base import BACKENDS
    from pdx.serving.deploy_config import load_deploy_config

    class EchoBackend(ModelBackend):
        name = "echo-test"

    with pytest.raises(ConfigError, match=r"model\.backend.*synthetic, transformers"):
        load_deploy_config(dotted=["model.backend=echo-test"])
    register_backend(EchoBackend)  # type: ignore[type-abstract]
    try:
        assert load_deploy_config(dotted=["model.backend=echo-test"]).model.backend == "echo-test"
        assert "echo-test" in backend_names()
    finally:
        del BACKENDS["echo-test"]


def test_unknown_preset_is_a_clear_error() -> None:
    with pytest.raises(InputError, match=r"model\.preset"):
        create_backend(BackendConfig(preset="no-such-model"))


def test_two_builds_have_identical_weights_and_outputs(tiny) -> None:  # type: ignore[no-untyped-def]
    other = create_backend(BackendConfig())
    assert other.model_version == tiny.model_version
    assert greedy(other, PROMPT, 12) == greedy(tiny, PROMPT, 12)
    seeded = create_backend(BackendConfig(seed=1))
    assert seeded.model_version != tiny.model_version


def test_greedy_matches_transformers_generate(tiny) -> None:  # type: ignore[no-untyped-def]
    ids = torch.tensor([PROMPT])
    out = tiny.model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
    )
    assert greedy(tiny, PROMPT, 12) == out[0, len(PROMPT) :].tolist()


def test_kv_is_real_cache_with_expected_layout(tiny) -> None:  # type: ignore[no-untyped-def]
    state, _ = tiny.prefill(PROMPT)
    # tiny-llama: 2 layers x (K, V), each [1, kv_heads=2, tokens, head_dim=16], fp32
    assert len(state.tensors) == 4
    assert all(t.shape == (1, 2, len(PROMPT), 16) for t in state.tensors)
    assert state.nbytes == 4 * 2 * len(PROMPT) * 16 * 4
    assert state.roles == ["key", "value", "key", "value"]


@pytest.mark.parametrize("codec", ["raw", "zstd", "lz4-planes"])
def test_lossless_wire_round_trip_continues_identically(tiny, codec: str) -> None:  # type: ignore[no-untyped-def]
    state, logits = tiny.prefill(PROMPT)
    enc = encode_kv(state, codec, num_layers=2)
    assert enc.layout["codec"] == codec and sum(enc.layout["tensor_bytes"]) == len(enc.payload)
    rebuilt = decode_kv(enc.payload, enc.layout, tiny, len(PROMPT))
    for a, b in zip(state.tensors, rebuilt.tensors, strict=True):
        assert torch.equal(a, b)
    first = pick_token(logits, 0, 0, 0)
    _, l1 = tiny.decode_step([state], [first])
    _, l2 = tiny.decode_step([rebuilt], [first])
    assert torch.equal(l1, l2)


def test_truncated_payload_is_rejected(tiny) -> None:  # type: ignore[no-untyped-def]
    state, _ = tiny.prefill(PROMPT)
    enc = encode_kv(state, "raw", num_layers=2)
    with pytest.raises(InputError, match="kv payload"):
        decode_kv(enc.payload[:-10], enc.layout, tiny, len(PROMPT))


def test_batched_step_equals_separate_steps(tiny) -> None:  # type: ignore[no-untyped-def]
    # Continuous batching pads sequences of different lengths; results must not change.
    a_prompt, b_prompt = PROMPT, [5, 6, 7]
    alone = [greedy(tiny, p, 8) for p in (a_prompt, b_prompt)]
    sa, la = tiny.prefill(a_prompt)
    sb, lb = tiny.prefill(b_prompt)
    toks = [[pick_token(la, 0, 0, 0)], [pick_token(lb, 0, 0, 0)]]
    states = [sa, sb]
    for _ in range(7):
        states, logits = tiny.decode_step(states, [t[-1] for t in toks])
        for row in range(2):
            toks[row].append(pick_token(logits[row], 0, 0, 0))
    assert toks == alone


def test_sampling_is_reproducible_per_seed_and_position() -> None:
    logits = torch.randn(260)
    assert pick_token(logits, 0.8, 7, 3) == pick_token(logits.clone(), 0.8, 7, 3)
    assert pick_token(logits, 0.0, 7, 3) == int(logits.argmax())


def test_synthetic_tiny_matches_transformers_tiny_bytes(tiny) -> None:  # type: ignore[no-untyped-def]
    syn = create_backend(BackendConfig(backend="synthetic", preset="tiny-llama"))
    state, _ = syn.prefill(PROMPT)
    assert state.nbytes == tiny.prefill(PROMPT)[0].nbytes
    assert syn.describe()["synthetic"] is True


def test_synthetic_llama_8b_bytes_match_published_size() -> None:
    # 131,072 bytes per token (bf16) for Llama-3.1-8B; the backend ships exactly that.
    spec = synthetic_spec("llama-3.1-8b")
    assert spec.kv_bytes(100) == 100 * 131_072
    syn = create_backend(
        BackendConfig(backend="synthetic", preset="llama-3.1-8b", synthetic_time_scale=0)
    )
    state, _ = syn.prefill(list(range(4, 104)))
    assert state.nbytes == 100 * 131_072
    enc = encode_kv(state, "raw", num_layers=32)
    rebuilt = decode_kv(enc.payload, enc.layout, syn, 100)
    assert rebuilt.nbytes == state.nbytes


def test_synthetic_roofline_times() -> None:
    syn = create_backend(
        BackendConfig(backend="synthetic", preset="llama-3.1-8b", prefill_tflops=100)
    )
    params = syn.spec.params_active  # type: ignore[attr-defined]
    assert syn.prefill_seconds(1000) == pytest.approx(2 * 1000 * params / 100e12)  # type: ignore[attr-defined]


@pytest.mark.parametrize("compute", ["sleep", "spin"])
def test_synthetic_compute_passes_the_roofline_time_asleep_or_on_a_core(compute: str) -> None:
    # tiny-llama, 1e5 active params: 100 tokens at 4e-5 TFLOP/s = 0.5 s of prefill.
    ids = list(range(4, 104))
    instant = create_backend(BackendConfig(backend="synthetic", synthetic_time_scale=0))
    want_state, want_logits = instant.prefill(ids)
    cfg = BackendConfig(backend="synthetic", prefill_tflops=4e-5, synthetic_compute=compute)
    syn = create_backend(cfg)
    layers: list[int] = []
    for run in (
        lambda: syn.prefill(ids),
        lambda: syn.prefill_layers(ids, lambda tensors, _roles: layers.append(len(tensors))),
    ):
        wall, cpu = time.perf_counter(), time.thread_time()
        state, logits = run()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        assert 0.5 <= wall < 3.0
        if compute == "spin":  # this thread computed (a busy shared box lends it less)
            assert cpu > 0.05 and syn.clock.products > 0  # type: ignore[attr-defined]
        else:
            assert cpu < 0.02
        assert state.nbytes == want_state.nbytes and torch.equal(logits, want_logits)
    assert layers == [2, 2]  # each layer's K and V, handed over as the pass reaches them


@given(st.text(max_size=40))
def test_byte_tokenizer_round_trips(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(4 <= i < 260 for i in ids)
    assert tok.decode(ids) == text


def test_tiny_presets_import_without_torch() -> None:
    """Reading the preset dicts (pdx accept's pre-flight does) must not import torch."""
    code = (
        "import sys\n"
        "from pdx.serving.backends.presets import TINY_PRESETS, tiny_config_json\n"
        "import pdx.accept.preflight.kv\n"
        "assert tiny_config_json('tiny-llama')['num_key_value_heads'] == 2\n"
        "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "print(','.join(heavy) or 'none')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "none"


def test_old_preset_import_path_still_works() -> None:
    from pdx.serving.backends import presets, transformers_backend

    assert transformers_backend.TINY_PRESETS is presets.TINY_PRESETS
    with pytest.raises(InputError, match=r"model\.preset"):
        presets.tiny_preset_config("no-such-model")
