"""Tokenizers: a byte-level one for tiny models, and a wrapper over a checkpoint's own."""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import lru_cache
from typing import Any

from pdx.serving.backends.presets import TINY_CHAT_TEMPLATE


@lru_cache(maxsize=8)
def _compiled(template: str) -> Any:
    # A sandboxed Jinja2 environment, as Hugging Face renders chat templates: a template is
    # configuration, and must not reach Python objects.
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(template)


class Tokenizer(ABC):
    """Text ↔ token ids."""

    chat_template: str | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Text → ids."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Ids → text (ids the tokenizer cannot map are skipped)."""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (for logprobs; may be part of a character)."""
        return self.decode([token_id]).encode("utf-8")

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages → prompt ids with the generation prompt appended."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = _compiled(self.chat_template).render(messages=messages, add_generation_prompt=True)
        return self.encode(text)


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids ``offset .. offset+255``; ids below ``offset`` are special (0 = BOS).

    It carries the tiny presets' chat template, so chat works on them out of the box.
    """

    def __init__(self, offset: int = 4, chat_template: str | None = TINY_CHAT_TEMPLATE) -> None:
        self.offset = offset
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes shifted by the special-id offset."""
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; specials and ids outside the byte range are dropped."""
        raw = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The one byte an id stands for (nothing for a special id)."""
        byte = token_id - self.offset
        return bytes([byte]) if 0 <= byte < 256 else b""


class HFTokenizer(Tokenizer):
    """A checkpoint's own tokenizer (``AutoTokenizer``)."""

    def __init__(self, tok: Any) -> None:
        self._tok = tok
        self.chat_template = getattr(tok, "chat_template", None)

    def encode(self, text: str) -> list[int]:
        """Ids without special tokens added."""
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Ids to text, keeping specials out."""
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Chat messages → prompt ids with the generation prompt appended."""
        out = self._tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if hasattr(out, "keys"):  # some versions return a BatchEncoding regardless
            out = out["input_ids"]
        return [int(t) for t in out]
