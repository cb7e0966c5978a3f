"""Backend base class, the shared config, and the table of backends by name.

:mod:`pdx.serving.backends.registry` registers and builds backends through that table;
the config checks a backend's name against it, so a backend added with
``register_backend`` can be chosen from the deploy config.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

if TYPE_CHECKING:
    import torch

    from pdx.serving.backends.tokenizer import Tokenizer


#: Every backend by name: its class once loaded, else where to import it from ("module:Class";
#: the built-ins load on first use, so naming a backend does not import torch).
#: :func:`pdx.serving.backends.registry.register_backend` adds to it.
BACKENDS: dict[str, type[ModelBackend] | str] = {
    "synthetic": "pdx.serving.backends.synthetic:SyntheticBackend",
    "transformers": "pdx.serving.backends.transformers_backend:TransformersBackend",
}


class BackendConfig(BaseModel):
    """Which model to serve and how. Every process of a deployment builds the same model from it."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field("transformers", description="a registered backend's name")
    preset: str = Field("tiny-llama", description="built-in tiny config or measure-kv preset name")
    checkpoint: str | None = Field(None, description="local checkpoint dir (transformers only)")
    seed: int = Field(0, description="seed for random weights, identical in every process")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int = Field(
        1, ge=0, description="CPU threads for torch in each process (0 = torch's default)"
    )
    max_context_tokens: int | None = Field(None, gt=0, description="default: the model's limit")
    prefill_tflops: float = Field(50.0, gt=0, description="synthetic: effective prefill TFLOP/s")
    decode_hbm_gbps: float = Field(2000.0, gt=0, description="synthetic: HBM bandwidth in GB/s")
    synthetic_time_scale: float = Field(1.0, ge=0, description="synthetic: multiply compute time")
    synthetic_compute: Literal["sleep", "spin"] = Field(
        "sleep",
        description="synthetic: compute time asleep (no CPU), or spun on matrix products that "
        "keep torch_threads cores busy with the GIL released (as a forward pass does)",
    )

    @field_validator("backend")
    @classmethod
    def _registered(cls, value: str) -> str:
        if value not in BACKENDS:
            raise ValueError(f"unknown backend; expected one of {', '.join(BACKENDS)}")
        return value


@dataclass
class KVState:
    """One sequence's KV cache: tensors in a fixed order (layer 0 key, layer 0 value, ...)."""

    tensors: list[torch.Tensor]
    length: int
    roles: list[Literal["key", "value", "other"]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes the tensors occupy uncompressed."""
        return sum(t.numel() * t.element_size() for t in self.tensors)


Role = Literal["key", "value", "other"]
#: Called (on the model thread) with one layer's KV tensors and their roles, in layer order,
#: as soon as the forward pass has produced them; the tensors are not changed afterwards.
LayerSink = Callable[[list["torch.Tensor"], list[Role]], None]


class ModelBackend(ABC):
    """Runs prefill and batched decode steps for one model; builds identical weights everywhere."""

    name: ClassVar[str]
    synthetic: ClassVar[bool] = False

    def __init__(self, cfg: BackendConfig) -> None:
        self.cfg = cfg

    @property
    @abstractmethod
    def model_version(self) -> str:
        """Identifies weights + config; prefill and decode must agree on it."""

    @property
    @abstractmethod
    def max_context_tokens(self) -> int:
        """Longest prompt + output the model accepts."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of token ids."""

    @property
    @abstractmethod
    def tokenizer(self) -> Tokenizer:
        """Text ↔ token ids."""

    @property
    def eos_token_id(self) -> int | None:
        """End-of-sequence id, if the model has one."""
        return None

    @property
    def prefill_tflops(self) -> float:
        """Effective prefill speed (2 × tokens × parameters / s, in TFLOP/s); 0 = unknown.

        The router's transfer-vs-recompute break-even uses it for the default
        ``local_prefill_max_tokens``.
        """
        return 0.0

    @abstractmethod
    def prefill(self, token_ids: list[int]) -> tuple[KVState, torch.Tensor]:
        """Run the prompt; return its KV and the logits of the next token (1-D)."""

    def prefill_layers(
        self, token_ids: list[int], on_layer: LayerSink
    ) -> tuple[KVState, torch.Tensor]:
        """:meth:`prefill`, handing each layer's KV to ``on_layer`` as soon as it exists.

        The state returned holds the same tensors, in the same order. This default hands
        every layer over once the whole pass is done; backends that can do better override it.
        """
        state, logits = self.prefill(token_ids)
        roles = state.roles or ["other"] * len(state.tensors)
        for a in range(0, len(state.tensors), 2):
            on_layer(state.tensors[a : a + 2], list(roles[a : a + 2]))
        return state, logits

    def kv_token_axes(self, tensors: list[torch.Tensor]) -> list[int] | None:
        """Each KV tensor's token axis, so a prefix cache can cut and join it; None when this
        backend's KV cannot be cut at a token (then it keeps no prefix cache)."""
        return None

    def prefill_after(
        self, token_ids: list[int], prefix: KVState, on_layer: LayerSink | None = None
    ) -> tuple[KVState, torch.Tensor]:
        """:meth:`prefill` of a prompt whose first ``prefix.length`` tokens' KV is ``prefix``:
        only the rest is computed. Returns the whole prompt's state; ``on_layer`` gets each
        layer's whole-prompt KV as :meth:`prefill_layers` does. Backends with
        :meth:`kv_token_axes` implement it."""
        raise NotImplementedError(f"{self.name}: no prefill after a cached prefix")

    def kv_bytes_bound(self, tokens: int) -> tuple[int, int]:
        """(uncompressed KV bytes, tensor count) of a ``tokens``-token prompt, before it runs."""
        raise NotImplementedError(f"{self.name}: KV size not known before prefill")

    @abstractmethod
    def decode_step(
        self, states: list[KVState], last_tokens: list[int]
    ) -> tuple[list[KVState], torch.Tensor]:
        """One batched step: feed each last token; return new states and logits [B, V]."""

    @abstractmethod
    def kv_from_tensors(self, tensors: list[torch.Tensor], length: int) -> KVState:
        """Rebuild a state received over the wire (tensors in :attr:`KVState.tensors` order)."""

    def describe(self) -> dict[str, object]:
        """Label for outputs: backend, model, synthetic or not."""
        return {
            "backend": self.name,
            "model": self.cfg.checkpoint or self.cfg.preset,
            "model_version": self.model_version,
            "synthetic": self.synthetic,
            "max_context_tokens": self.max_context_tokens,
        }
