"""The ``synthetic`` backend: no weights, real KV volume, roofline compute time.

It lets a CPU box push a large model's KV (the exact per-layer layout and byte size that
measure-kv computes for the model) through a real link. Tokens are a deterministic function
of the previous token and position, so two paths can still be compared; every output is
labelled synthetic.

The roofline's compute time passes asleep (``model.synthetic_compute: sleep``, the default: no
CPU, so everything else in the process runs as if on an idle machine) or spinning
(``spin``: back-to-back 256×256 float32 matrix products on the model thread until the same
deadline, so ``model.torch_threads`` cores (default one) are busy for the modelled time, with
the GIL released inside each product as torch releases it for a real forward pass).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from pdx.errors import InputError
from pdx.serving.backends.base import BackendConfig, KVState, LayerSink, ModelBackend
from pdx.serving.backends.tokenizer import ByteTokenizer, Tokenizer

_VOCAB = 260
_KV_CACHE_LENGTHS = 2  # prompt lengths whose KV bytes are kept for reuse
_SPIN_SIZE = 256  # one spin product: 33.5 MFLOP, ~0.4 ms on one core of a small CPU


@dataclass(frozen=True)
class SyntheticLayer:
    """One layer: per-token bytes (K+V, or one latent if ``single``), window, fixed state."""

    bytes_per_token: int
    window_tokens: int | None = None
    state_bytes: int = 0
    single: bool = False  # MLA: one latent per token, not separate K and V

    def tokens_kept(self, seq: int) -> int:
        """Tokens of KV held after ``seq`` tokens."""
        return seq if self.window_tokens is None else min(seq, self.window_tokens)


@dataclass(frozen=True)
class SyntheticSpec:
    """Layers and parameter count of the model being imitated."""

    layers: tuple[SyntheticLayer, ...]
    params_active: float
    bytes_per_param: int = 2
    max_context: int = 131072
    # Where in a layer's compute its K and V exist: after the attention projections (the
    # rest of the layer never changes them). 1.0 = at the layer's end.
    kv_ready_fraction: float = 1.0

    def kv_bytes(self, seq: int) -> int:
        """Exact KV bytes for one request of ``seq`` tokens."""
        return sum(x.tokens_kept(seq) * x.bytes_per_token + x.state_bytes for x in self.layers)


def _from_measure_kv(preset: str) -> SyntheticSpec | None:
    """The layout measure-kv computes from the preset's config.json (all attention families)."""
    try:
        text = resources.files("pdx.kv.presets").joinpath(f"{preset}.json").read_text()
        from pdx.kv.spec import build_spec
    except (FileNotFoundError, ModuleNotFoundError):
        return None
    config: dict[str, Any] = json.loads(text)
    try:
        spec = build_spec(config, name=preset)
    except ModuleNotFoundError:  # measure-kv installed without its family tables
        return None
    layers = tuple(
        SyntheticLayer(
            bytes_per_token=layer.bytes_per_token,
            window_tokens=layer.window_tokens if layer.kind == "sliding" else None,
            state_bytes=layer.state_bytes,
            single=layer.kind == "mla" or layer.bytes_per_token % 4 != 0,
        )
        for layer in spec.layers
        if layer.kind != "none"
    )
    ctx = int(config.get("max_position_embeddings", 131072))
    return SyntheticSpec(layers=layers, params_active=float(spec.params_active), max_context=ctx,
                         kv_ready_fraction=_kv_ready_fraction(config))  # fmt: skip


def _kv_ready_fraction(config: dict[str, Any]) -> float:
    """Share of a dense decoder layer's weights (so of its prefill FLOPs) in its Q, K and V
    projections, which run first: q + 2 kv projections / (those + output + gated MLP).
    1.0 when the config does not say (MoE, hybrid and other layouts)."""
    try:
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        mlp = 3 * hidden * int(config["intermediate_size"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return 1.0
    if config.get("num_local_experts") or config.get("n_routed_experts"):
        return 1.0
    qkv = hidden * (heads + 2 * kv_heads) * head_dim
    total = qkv + heads * head_dim * hidden + mlp
    return qkv / total if total > 0 else 1.0


def _tiny() -> SyntheticSpec:
    # Same layout as the tiny transformers preset (2 layers, 2 KV heads × 16 dims, fp32).
    layer = SyntheticLayer(bytes_per_token=2 * 2 * 16 * 4)
    return SyntheticSpec(layers=(layer, layer), params_active=1.0e5, max_context=1024)


def synthetic_spec(preset: str) -> SyntheticSpec:
    """Spec for a preset name: ``tiny-llama`` or any measure-kv preset."""
    if preset == "tiny-llama":
        return _tiny()
    spec = _from_measure_kv(preset)
    if spec is None:
        raise InputError("model.preset", preset, "tiny-llama or a measure-kv preset name")
    return spec


class ComputeClock:
    """Lets modelled compute time pass until a deadline: asleep, or spinning on products.

    A spin is bounded by its deadline (``time.perf_counter``) and overshoots it by at most
    one product; its operands are only read, so threads may share a clock.
    """

    def __init__(self, spin: bool) -> None:
        self.spin = spin
        gen = torch.Generator().manual_seed(0)
        self._a = torch.rand(_SPIN_SIZE, _SPIN_SIZE, generator=gen) if spin else None
        self._b = torch.rand(_SPIN_SIZE, _SPIN_SIZE, generator=gen) if spin else None
        self.products = 0  # spin products run so far

    def until(self, deadline_s: float) -> None:
        """Return once ``time.perf_counter()`` has reached ``deadline_s``."""
        if self._a is None or self._b is None:
            time.sleep(max(0.0, deadline_s - time.perf_counter()))
            return
        while time.perf_counter() < deadline_s:
            torch.mm(self._a, self._b)
            self.products += 1

    def wait(self, seconds: float) -> None:
        """Let ``seconds`` of compute pass from now."""
        self.until(time.perf_counter() + seconds)


class SyntheticBackend(ModelBackend):
    """KV tensors of the imitated model's exact bytes; compute time by the roofline, asleep
    or spinning (``synthetic_compute``)."""

    name = "synthetic"
    synthetic = True

    def __init__(self, cfg: BackendConfig) -> None:
        super().__init__(cfg)
        self.spec = synthetic_spec(cfg.preset)
        self._tokenizer = ByteTokenizer()
        self._gen_seed = cfg.seed
        self._kv_cache: dict[int, list[tuple[list[torch.Tensor], list[Any]]]] = {}
        self.clock = ComputeClock(cfg.synthetic_compute == "spin")
        if self.clock.spin and cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)  # the spin's cores, as for a real model

    @property
    def model_version(self) -> str:
        return f"synthetic:{self.cfg.preset}+{self.cfg.seed}"

    @property
    def max_context_tokens(self) -> int:
        return min(self.cfg.max_context_tokens or self.spec.max_context, self.spec.max_context)

    @property
    def vocab_size(self) -> int:
        return _VOCAB

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def prefill_tflops(self) -> float:
        """The configured roofline speed (what the compute time imitates)."""
        return self.cfg.prefill_tflops

    def prefill_seconds(self, tokens: int) -> float:
        """Roofline: ``2 × tokens × active params / FLOP/s``."""
        return 2 * tokens * self.spec.params_active / (self.cfg.prefill_tflops * 1e12)

    def decode_step_seconds(self, context_tokens: int) -> float:
        """Roofline: ``(weight bytes + KV bytes read) / HBM bandwidth``."""
        weight_bytes = self.spec.params_active * self.spec.bytes_per_param
        return (weight_bytes + self.spec.kv_bytes(context_tokens)) / (
            self.cfg.decode_hbm_gbps * 1e9
        )

    def _next_token(self, last: int, position: int) -> int:
        return (last * 1103515245 + position * 12345 + 7 + self._gen_seed) % (_VOCAB - 4) + 4

    def _logits(self, tokens: list[int]) -> torch.Tensor:
        logits = torch.zeros(len(tokens), _VOCAB)
        logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
        return logits

    def _layers(self, length: int) -> Iterator[tuple[list[torch.Tensor], list[Any]]]:
        """Each layer's tensors and roles, in order: the same bytes for the same length.

        The bytes carry no information, so generating them is not the imitated model's work:
        the layers of the last few lengths are kept (never changed by anyone) and handed out
        again, instead of drawing hundreds of MiB of random bytes per request (seconds of CPU
        an 8B-class prompt would otherwise add to the roofline's prefill time).
        """
        cached = self._kv_cache.get(length)
        if cached is None:
            cached = list(self._generate_layers(length))
            self._kv_cache[length] = cached
            while len(self._kv_cache) > _KV_CACHE_LENGTHS:
                del self._kv_cache[next(iter(self._kv_cache))]
        for tensors, roles in cached:
            yield list(tensors), list(roles)

    def _generate_layers(self, length: int) -> Iterator[tuple[list[torch.Tensor], list[Any]]]:
        gen = torch.Generator().manual_seed(self.cfg.seed + length)
        for layer in self.spec.layers:
            tensors: list[torch.Tensor] = []
            roles: list[Any] = []
            n = layer.tokens_kept(length)
            parts = 1 if layer.single else 2
            per = layer.bytes_per_token // parts
            for part in range(parts):
                tensors.append(torch.randint(0, 256, (1, n, per), generator=gen, dtype=torch.uint8))
                roles.append("other" if layer.single else ("key", "value")[part])
            if layer.state_bytes:
                tensors.append(torch.randint(0, 256, (layer.state_bytes,), dtype=torch.uint8))
                roles.append("other")
            yield tensors, roles

    def _state(self, length: int) -> KVState:
        tensors: list[torch.Tensor] = []
        roles: list[Any] = []
        for layer_tensors, layer_roles in self._layers(length):
            tensors += layer_tensors
            roles += layer_roles
        return KVState(tensors=tensors, length=length, roles=roles)

    def prefill(self, token_ids: list[int]) -> tuple[KVState, torch.Tensor]:
        self.clock.wait(self.prefill_seconds(len(token_ids)) * self.cfg.synthetic_time_scale)
        first = self._next_token(sum(token_ids), len(token_ids))
        return self._state(len(token_ids)), self._logits([first])[0]

    def prefill_layers(
        self, token_ids: list[int], on_layer: LayerSink
    ) -> tuple[KVState, torch.Tensor]:
        """Per layer the roofline's share of the compute time (each layer holds the same
        parameters); a layer's KV is handed to ``on_layer`` once its Q/K/V projections'
        share of that time has passed (``kv_ready_fraction``), as a real layer produces it."""
        return self._timed_layers(token_ids, len(token_ids), on_layer)

    def kv_token_axes(self, tensors: list[torch.Tensor]) -> list[int] | None:
        """Whole-context layers only ([1, tokens, bytes]): a sliding window or a fixed state
        is not a run of tokens that blocks can hold."""
        if any(x.window_tokens is not None or x.state_bytes for x in self.spec.layers):
            return None
        return [1] * len(tensors)

    def prefill_after(
        self, token_ids: list[int], prefix: KVState, on_layer: LayerSink | None = None
    ) -> tuple[KVState, torch.Tensor]:
        """The roofline time of the tokens after the prefix only. The KV is the whole prompt's
        (its bytes carry no information here, so the prefix's are not copied in)."""
        computed = len(token_ids) - prefix.length
        if on_layer is not None:
            return self._timed_layers(token_ids, computed, on_layer)
        self.clock.wait(self.prefill_seconds(computed) * self.cfg.synthetic_time_scale)
        first = self._next_token(sum(token_ids), len(token_ids))
        return self._state(len(token_ids)), self._logits([first])[0]

    def _timed_layers(
        self, token_ids: list[int], computed: int, on_layer: LayerSink
    ) -> tuple[KVState, torch.Tensor]:
        n = len(token_ids)
        per_layer_s = (
            self.prefill_seconds(computed) * self.cfg.synthetic_time_scale / len(self.spec.layers)
        )
        tensors: list[torch.Tensor] = []
        roles: list[Any] = []
        start = time.perf_counter()
        ready = self.spec.kv_ready_fraction
        for i, (layer_tensors, layer_roles) in enumerate(self._layers(n)):
            # The layer's K and V exist once its attention projections ran.
            self.clock.until(start + (i + ready) * per_layer_s)
            on_layer(layer_tensors, layer_roles)
            tensors += layer_tensors
            roles += layer_roles
        end = start + len(self.spec.layers) * per_layer_s  # the last layer's remainder
        self.clock.until(end)
        first = self._next_token(sum(token_ids), n)
        return KVState(tensors=tensors, length=n, roles=roles), self._logits([first])[0]

    def kv_bytes_bound(self, tokens: int) -> tuple[int, int]:
        count = sum((1 if x.single else 2) + (1 if x.state_bytes else 0) for x in self.spec.layers)
        return self.spec.kv_bytes(tokens), count

    def kv_from_tensors(self, tensors: list[torch.Tensor], length: int) -> KVState:
        return KVState(tensors=tensors, length=length, roles=[])

    def decode_step(
        self, states: list[KVState], last_tokens: list[int]
    ) -> tuple[list[KVState], torch.Tensor]:
        context = sum(s.length for s in states)
        self.clock.wait(self.decode_step_seconds(context) * self.cfg.synthetic_time_scale)
        # The KV is not extended token by token (it carries no information here); only its
        # length advances, which is what the roofline step time depends on.
        new = [KVState(s.tensors, s.length + 1, s.roles) for s in states]
        nxt = [self._next_token(t, s.length) for t, s in zip(last_tokens, states, strict=True)]
        return new, self._logits(nxt)
