"""Bytes a serving engine allocates and moves for one request, from a KV spec.

``transformers`` (pdx's own pair) holds exactly what :class:`pdx.kv.spec.KVSpec` says. vLLM's
v1 engine allocates whole blocks of ``block_size`` tokens per layer and keeps fixed states as
one page per request; :func:`vllm_kv_bytes` applies its rules (written from vLLM's source, see
:data:`VLLM_RULES`) so a deployment on vLLM sees the bytes its KV connector moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdx.errors import InputError
from pdx.kv.layers import LayerSpec, StateTensor
from pdx.kv.spec import KVSpec, build_spec, check_seq

#: Which vLLM rules these are, and where they were read.
VLLM_RULES = (
    "vLLM v1 engine, main branch 2026 (0.3x series): vllm/v1/kv_cache_interface.py, "
    "v1/core/single_type_kv_cache_manager.py (sliding / chunked block release), "
    "model_executor/layers/mamba/mamba_utils.py (state shapes and dtypes), "
    "model_executor/models/config.py (hybrid block size and mamba page padding), "
    "config/cache.py (block size 16)"
)
#: vLLM's default block size (tokens) per device: CacheConfig.DEFAULT_BLOCK_SIZE on GPUs,
#: the CPU platform's 128.
DEFAULT_BLOCK_SIZE: dict[str, int] = {"gpu": 16, "cpu": 128}
#: Attention backends take block sizes in multiples of 16 (hybrid block-size rule).
_BLOCK_ALIGN = 16
#: vLLM's sparse-attention indexer keeps its keys in fp8 with one float32 scale per 128.
_INDEXER_QUANT_BLOCK = 128


@dataclass(frozen=True)
class VLLMLayer:
    """What vLLM holds for one layer of one request."""

    index: int
    kind: str
    blocks: int
    block_bytes: int
    state_page_bytes: int
    state_bytes: int = 0  # the states before padding

    @property
    def bytes(self) -> int:
        """Whole blocks of this layer plus its (padded) state page."""
        return self.blocks * self.block_bytes + self.state_page_bytes


@dataclass(frozen=True)
class VLLMSizing:
    """The bytes vLLM allocates for a request of ``prompt_tokens`` tokens, layer by layer."""

    prompt_tokens: int
    block_size: int
    attention_block_size: int
    state_page_bytes: int
    state_page_unpadded: int
    layers: list[VLLMLayer]
    rules: str = VLLM_RULES
    notes: list[str] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        """Every block and state page of the request."""
        return sum(la.bytes for la in self.layers)

    @property
    def growing_bytes(self) -> int:
        """Blocks of full-attention / MLA / hybrid layers."""
        return sum(la.blocks * la.block_bytes for la in self.layers if la.kind != "sliding")

    @property
    def sliding_bytes(self) -> int:
        """Blocks still held by sliding-window and chunked layers."""
        return sum(la.blocks * la.block_bytes for la in self.layers if la.kind == "sliding")

    @property
    def state_bytes(self) -> int:
        """State pages (padded to the attention page in hybrid models)."""
        return sum(la.state_page_bytes for la in self.layers)

    @property
    def unpadded_state_bytes(self) -> int:
        """The states themselves, before page padding."""
        return sum(la.state_bytes for la in self.layers)


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


def vllm_block_size(block_size: int | None, device: str = "gpu") -> int:
    """``--block-size`` or vLLM's default for ``device`` (gpu 16, cpu 128)."""
    if block_size is None:
        if device not in DEFAULT_BLOCK_SIZE:
            raise InputError("--device", device, f"one of {', '.join(DEFAULT_BLOCK_SIZE)}")
        return DEFAULT_BLOCK_SIZE[device]
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise InputError("--block-size", block_size, "a positive number of tokens")
    return block_size


def vllm_state(state: StateTensor) -> StateTensor:
    """A state as vLLM shapes it: a convolution keeps ``kernel - 1`` columns."""
    if state.name != "conv":
        return state
    *dims, kernel = state.shape
    return StateTensor(state.name, (*dims, kernel - 1), state.dtype)


def vllm_token_bytes(layer: LayerSpec) -> int:
    """Bytes per token of a layer's blocks (the indexer in fp8 + scales, as vLLM keeps it)."""
    total = 0
    for tensor in layer.tokens:
        if tensor.name == "indexer_keys":
            total += tensor.elems + 4 * cdiv(tensor.elems, _INDEXER_QUANT_BLOCK)
        else:
            total += tensor.bytes_per_token
    return total


def vllm_kv_bytes(
    spec_or_config: KVSpec | dict[str, Any],
    prompt_tokens: int,
    block_size: int | None = None,
    *,
    device: str = "gpu",
    dtype: str = "bf16",
    state_dtype: str = "auto",
) -> VLLMSizing:
    """The bytes vLLM allocates (and its KV connector moves) for a prompt of ``prompt_tokens``.

    ``spec_or_config`` is a spec built with ``engine="vllm"`` or a Hugging Face config dict
    (then ``dtype`` / ``state_dtype`` apply). ``block_size`` None means vLLM's default for
    ``device``.
    """
    check_seq(prompt_tokens)
    if isinstance(spec_or_config, dict):
        spec = build_spec(
            spec_or_config, name="model", dtype=dtype, state_dtype=state_dtype, engine="vllm"
        )
    else:
        spec = spec_or_config
        if spec.engine != "vllm":
            raise InputError("spec.engine", spec.engine, "a spec built with engine='vllm'")
    block = vllm_block_size(block_size, device)
    attn_block, page, unpadded, notes = _hybrid_block_size(spec, block)
    layers = [_layer(la, prompt_tokens, attn_block, page) for la in spec.layers]
    return VLLMSizing(prompt_tokens, block, attn_block, page, unpadded, layers, notes=notes)


def _state_page(layer: LayerSpec) -> int:
    return sum(vllm_state(s).nbytes for s in layer.states)


def _hybrid_block_size(spec: KVSpec, block: int) -> tuple[int, int, int, list[str]]:
    """Attention block size and the (padded) state page: vLLM makes them one page size."""
    pages = [_state_page(la) for la in spec.layers if la.states]
    attention = [la for la in spec.layers if la.tokens]
    if not pages:
        return block, 0, 0, []
    mamba_page = max(pages)
    if not attention:
        return block, mamba_page, mamba_page, []
    per_token = max(_attention_page_per_token(la) for la in attention)
    needed = _BLOCK_ALIGN * cdiv(mamba_page, _BLOCK_ALIGN * per_token)
    attn_block = max(block, needed)
    padded = attn_block * per_token
    notes = []
    if attn_block != block:
        notes.append(
            f"vLLM raises the attention block size to {attn_block} tokens so one attention "
            f"page ({padded:,} B) holds a state page ({mamba_page:,} B)"
        )
    if padded != mamba_page:
        notes.append(f"vLLM pads each state page from {mamba_page:,} B to {padded:,} B")
    return attn_block, padded, mamba_page, notes


def _attention_page_per_token(layer: LayerSpec) -> int:
    """One layer's attention bytes per token as vLLM's page-size rule counts them."""
    return sum(t.bytes_per_token for t in layer.tokens if t.name in ("keys", "values"))


def _layer(layer: LayerSpec, prompt: int, block: int, page: int) -> VLLMLayer:
    per_token = vllm_token_bytes(layer)
    state = page if layer.states else 0
    raw = _state_page(layer)
    if not layer.tokens:
        return VLLMLayer(layer.index, layer.kind, 0, 0, state, raw)
    blocks = cdiv(prompt, block)
    if layer.kind == "sliding":
        blocks -= _skipped_tokens(layer, prompt) // block
    return VLLMLayer(layer.index, layer.kind, blocks, block * per_token, state, raw)


def _skipped_tokens(layer: LayerSpec, prompt: int) -> int:
    """Tokens whose blocks vLLM frees once ``prompt`` tokens are computed."""
    assert layer.window is not None
    if layer.mixer == "chunked":  # only the current chunk is attended to
        return prompt // layer.window * layer.window
    return max(0, prompt - layer.window + 1)


def vllm_max_blocks(layer: LayerSpec, block: int) -> int | None:
    """Most blocks a sliding layer keeps: ``cdiv(W - 1, block) + 1`` (chunked: the chunk)."""
    if layer.kind != "sliding" or layer.window is None:
        return None
    if layer.mixer == "chunked":
        return cdiv(layer.window, block)
    return cdiv(layer.window - 1, block) + 1


__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "VLLM_RULES",
    "VLLMLayer",
    "VLLMSizing",
    "vllm_block_size",
    "vllm_kv_bytes",
]
