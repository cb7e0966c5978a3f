"""The ``transformers`` backend: a real causal LM, from a local checkpoint or a tiny seeded preset.

Tiny presets are random-weight models built from a config with a fixed seed, so a prefill
process and a decode process build bit-identical weights without downloading anything.


``TINY_PRESETS`` lives in :mod:`pdx.serving.backends.presets` (torch-free) and is re-exported here.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdx.errors import InputError
from pdx.serving.backends.base import BackendConfig, KVState, LayerSink, ModelBackend
from pdx.serving.backends.presets import TINY_PRESETS, tiny_preset_config
from pdx.serving.backends.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["TINY_PRESETS", "TransformersBackend"]


def _pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _state_dict_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().float().cpu().numpy().tobytes()[:4096])
    return h.hexdigest()[:12]


class TransformersBackend(ModelBackend):
    """Real forward passes through ``AutoModelForCausalLM`` with a ``DynamicCache``."""

    name = "transformers"

    def __init__(self, cfg: BackendConfig) -> None:
        super().__init__(cfg)
        if cfg.torch_threads:
            # Per process: prefill and decode often share a small CPU box, where torch's
            # default (one spinning thread per core, in every process) stalls under load.
            torch.set_num_threads(cfg.torch_threads)
        self.device = _pick_device(cfg.device)
        if cfg.checkpoint:
            self.model, self._tokenizer = self._load_checkpoint(Path(cfg.checkpoint))
        else:
            self.model, self._tokenizer = self._build_tiny(cfg.preset, cfg.seed)
        self.model.to(self.device).eval()
        name = Path(cfg.checkpoint).name if cfg.checkpoint else cfg.preset
        self._version = f"{name}+{_state_dict_digest(self.model)}"
        limit = int(getattr(self.model.config, "max_position_embeddings", 2048))
        self._max_context = min(cfg.max_context_tokens or limit, limit)
        self._prefill_tflops = self._measure_prefill_tflops()

    def _measure_prefill_tflops(self, tokens: int = 256, runs: int = 3) -> float:
        """Time a few prompt forwards (the fastest counts: the box may be busy); TFLOP/s."""
        n = max(1, min(tokens, self._max_context - 1))
        ids = [4 + i % max(1, self.vocab_size - 4) for i in range(n)]
        params = sum(p.numel() for p in self.model.parameters())
        best = float("inf")
        for _ in range(runs):
            t0 = time.perf_counter()
            self.prefill(ids)
            best = min(best, time.perf_counter() - t0)
        return 2.0 * n * params / best / 1e12 if best > 0 else 0.0

    @property
    def prefill_tflops(self) -> float:
        return self._prefill_tflops

    def _build_tiny(self, preset: str, seed: int) -> tuple[Any, Tokenizer]:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = tiny_preset_config(preset)
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**config))
        return model.float(), ByteTokenizer()

    def _load_checkpoint(self, path: Path) -> tuple[Any, Tokenizer]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if not (path / "config.json").is_file():
            raise InputError("model.checkpoint", str(path), "a directory with config.json")
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
        try:
            tok: Tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
        except (OSError, ValueError):
            tok = ByteTokenizer()
        return model, tok

    @property
    def model_version(self) -> str:
        return self._version

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.model.config, "eos_token_id", None)
        return int(eos[0] if isinstance(eos, list) else eos) if eos is not None else None

    def config_json(self) -> str:
        """The model config as JSON (what a measure-kv run would size)."""
        return json.dumps(self.model.config.to_dict(), default=str)

    def _cache(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        from transformers import DynamicCache

        return DynamicCache(ddp_cache_data=pairs)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int]) -> tuple[KVState, torch.Tensor]:
        ids = torch.tensor([token_ids], device=self.device)
        out = self.model(input_ids=ids, use_cache=True)
        cache = out.cache
        tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        return self._state(tensors, len(token_ids)), out.logits[0, -1].float().cpu()

    @torch.inference_mode()
    def prefill_layers(
        self, token_ids: list[int], on_layer: LayerSink
    ) -> tuple[KVState, torch.Tensor]:
        """One forward pass; a hook on every layer's attention hands that layer's cache entry
        over the moment attention has run, before the layer's MLP (nothing after it changes
        the entry)."""
        from transformers import DynamicCache

        return self._forward(token_ids, DynamicCache(), 0, on_layer)

    def kv_token_axes(self, tensors: list[torch.Tensor]) -> list[int] | None:
        return [2] * len(tensors)  # [batch, kv heads, tokens, head dim]

    @torch.inference_mode()
    def prefill_after(
        self, token_ids: list[int], prefix: KVState, on_layer: LayerSink | None = None
    ) -> tuple[KVState, torch.Tensor]:
        t = prefix.tensors
        cache = self._cache([(t[i], t[i + 1]) for i in range(0, len(t), 2)])
        return self._forward(token_ids, cache, prefix.length, on_layer)

    def _forward(
        self, token_ids: list[int], cache: Any, cached: int, on_layer: LayerSink | None
    ) -> tuple[KVState, torch.Tensor]:
        """Run tokens ``cached:`` over ``cache`` (which holds the first ``cached``); the cache
        positions the new tokens after the cached ones."""
        handles = []

        def hook(module: Any, args: Any, kwargs: Any, output: Any) -> None:
            assert on_layer is not None
            entry = cache.layers[module.layer_idx]
            on_layer([entry.keys, entry.values], ["key", "value"])

        if on_layer is not None:
            for layer in self.model.model.layers:
                handles.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        try:
            ids = torch.tensor([token_ids[cached:]], device=self.device)
            out = self.model(input_ids=ids, cache=cache, use_cache=True)
        finally:
            for handle in handles:
                handle.remove()
        tensors = [t for layer in out.cache.layers for t in (layer.keys, layer.values)]
        return self._state(tensors, len(token_ids)), out.logits[0, -1].float().cpu()

    def kv_bytes_bound(self, tokens: int) -> tuple[int, int]:
        c = self.model.config
        heads = int(getattr(c, "num_key_value_heads", None) or c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
        item = next(self.model.parameters()).element_size()
        layers = int(c.num_hidden_layers)
        return 2 * layers * heads * head_dim * tokens * item, 2 * layers

    def _state(self, tensors: list[torch.Tensor], length: int) -> KVState:
        roles: list[Any] = ["key", "value"] * (len(tensors) // 2)
        return KVState(tensors=tensors, length=length, roles=roles)

    def kv_from_tensors(self, tensors: list[torch.Tensor], length: int) -> KVState:
        dtype = next(self.model.parameters()).dtype
        return self._state([t.to(self.device, dtype) for t in tensors], length)

    @torch.inference_mode()
    def decode_step(
        self, states: list[KVState], last_tokens: list[int]
    ) -> tuple[list[KVState], torch.Tensor]:
        # Sequences of different lengths share one forward pass: left-pad each cache to the
        # longest, mask the padding, and give every sequence its own position id.
        longest = max(s.length for s in states)
        pairs = []
        for i in range(0, len(states[0].tensors), 2):
            keys = torch.cat([_left_pad(s.tensors[i], longest - s.length) for s in states])
            values = torch.cat([_left_pad(s.tensors[i + 1], longest - s.length) for s in states])
            pairs.append((keys, values))
        cache = self._cache(pairs)
        mask = torch.zeros(len(states), longest + 1, dtype=torch.long, device=self.device)
        for row, s in enumerate(states):
            mask[row, longest - s.length :] = 1
        out = self.model(
            input_ids=torch.tensor([[t] for t in last_tokens], device=self.device),
            attention_mask=mask,
            position_ids=torch.tensor([[s.length] for s in states], device=self.device),
            cache=cache,
            use_cache=True,
        )
        new_states = []
        for row, s in enumerate(states):
            start = longest - s.length
            tensors = [
                t[row : row + 1, :, start:].clone()
                for layer in cache.layers
                for t in (layer.keys, layer.values)
            ]
            new_states.append(self._state(tensors, s.length + 1))
        return new_states, out.logits[:, -1].float().cpu()


def _left_pad(t: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(t, (0, 0, n, 0)) if n else t
