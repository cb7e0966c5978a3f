"""Tokenizers: a byte-level one for tiny models, and a wrapper over a checkpoint's own."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class Tokenizer(ABC):
    """Text ↔ token ids."""

    chat_template: str | None = None

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Text → ids."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str:
        """Ids → text (ids the tokenizer cannot map are skipped)."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids ``offset .. offset+255``; ids below ``offset`` are special (0 = BOS)."""

    def __init__(self, offset: int = 4) -> None:
        self.offset = offset

    def encode(self, text: str) -> list[int]:
        """UTF-8 bytes shifted by the special-id offset."""
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        """Bytes back to text; specials and ids outside the byte range are dropped."""
        raw = bytes(i - self.offset for i in ids if self.offset <= i < self.offset + 256)
        return raw.decode("utf-8", errors="replace")


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
