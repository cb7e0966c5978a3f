"""Per-layer KV facts: what one decoder layer keeps per token and per request, tensor by tensor.

The bottom of :mod:`pdx.kv`: the family rules (:mod:`pdx.kv.families`) build these, the
model spec (:mod:`pdx.kv.spec`) adds them up. Free of torch/transformers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

#: ``hybrid``: attention K/V that grow with length plus a fixed state, in the same layer.
LayerKind = Literal["full", "mla", "sliding", "linear", "hybrid", "none"]

#: Bytes per element for ``--dtype`` / ``--state-dtype`` and per-tensor dtypes.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
STATE_DTYPES = ("auto", "fp32", "bf16", "fp16")
#: Kinds whose per-token bytes grow without bound.
GROWING_KINDS = ("full", "mla", "hybrid")


@dataclass(frozen=True)
class TokenTensor:
    """One tensor of a layer's cache that grows by ``elems`` elements per token.

    ``name`` is the attribute of the transformers cache layer that holds it (``keys``,
    ``values``, ``indexer_keys``).
    """

    name: str
    elems: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """Bytes this tensor adds per token."""
        return self.elems * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class StateTensor:
    """One fixed-size state of a request (``conv`` or ``recurrent``), shape without the batch."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def elems(self) -> int:
        """Elements of the state."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the state."""
        return self.elems * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: the tensors that grow with the sequence and the fixed states.

    ``window_tokens`` is the number of tokens a sliding (or chunked) layer keeps once the
    sequence is longer than its window (the transformers cache keeps ``window - 1``: the next
    token's own K/V completes the window); ``window`` is the configured window itself.
    ``mixer`` names the rule that sized the layer (``attention``, ``mla``, ``mamba2``, ...).
    """

    index: int
    kind: LayerKind
    tokens: tuple[TokenTensor, ...] = ()
    states: tuple[StateTensor, ...] = ()
    window_tokens: int | None = None
    window: int | None = None
    mixer: str = "attention"
    detail: str = ""

    @property
    def kv_elems_per_token(self) -> int:
        """Elements added per token over every growing tensor."""
        return sum(t.elems for t in self.tokens)

    @property
    def bytes_per_token(self) -> int:
        """K/V (or latent) bytes this layer adds per token while it grows."""
        return sum(t.bytes_per_token for t in self.tokens)

    @property
    def state_bytes(self) -> int:
        """Fixed-size state bytes (conv + recurrent) per request."""
        return sum(s.nbytes for s in self.states)

    def tokens_kept(self, seq: int) -> int:
        """Tokens of K/V this layer holds after a prefill of ``seq`` tokens."""
        if self.kind in GROWING_KINDS:
            return seq
        if self.kind == "sliding":
            assert self.window_tokens is not None
            return min(seq, self.window_tokens)
        return 0

    def bytes_for(self, seq: int) -> int:
        """Exact bytes this layer holds for one request of ``seq`` tokens."""
        return self.tokens_kept(seq) * self.bytes_per_token + self.state_bytes
