"""Per-layer KV facts: what one decoder layer keeps per token and per request.

The bottom of :mod:`pdx.kv`: the family rules (:mod:`pdx.kv.families`) build these, the
model spec (:mod:`pdx.kv.spec`) adds them up. Free of torch/transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LayerKind = Literal["full", "mla", "sliding", "linear", "none"]

#: Bytes per element for ``--dtype`` / ``--state-dtype``.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
STATE_DTYPES = ("auto", "fp32", "bf16", "fp16")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: how its cache grows with sequence length and what it holds regardless.

    ``window_tokens`` is the number of tokens a sliding layer keeps once the sequence is longer
    than its window (the transformers cache keeps ``sliding_window - 1``: the next token's own K/V
    completes the window). ``conv_elems`` / ``recurrent_elems`` are the fixed-size per-request
    states of linear-attention / SSM layers.
    """

    index: int
    kind: LayerKind
    kv_elems_per_token: int
    kv_elem_bytes: int
    window_tokens: int | None = None
    conv_elems: int = 0
    recurrent_elems: int = 0
    state_elem_bytes: int = 0
    detail: str = ""

    @property
    def bytes_per_token(self) -> int:
        """K/V (or latent) bytes this layer adds per token while it grows."""
        return self.kv_elems_per_token * self.kv_elem_bytes

    @property
    def state_bytes(self) -> int:
        """Fixed-size state bytes (conv + recurrent) per request."""
        return (self.conv_elems + self.recurrent_elems) * self.state_elem_bytes

    def tokens_kept(self, seq: int) -> int:
        """Tokens of K/V this layer holds after a prefill of ``seq`` tokens."""
        if self.kind in ("full", "mla"):
            return seq
        if self.kind == "sliding":
            assert self.window_tokens is not None
            return min(seq, self.window_tokens)
        return 0

    def bytes_for(self, seq: int) -> int:
        """Exact bytes this layer holds for one request of ``seq`` tokens."""
        return self.tokens_kept(seq) * self.bytes_per_token + self.state_bytes
