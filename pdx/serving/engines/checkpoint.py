"""The embedded tiny model as a local checkpoint an engine can load: weights, tokenizer, template.

vLLM loads models from a directory (``config.json``, safetensors, a Hugging Face tokenizer).
:func:`export_tiny_checkpoint` writes the seeded random-weight preset there with a byte-level
tokenizer that maps text to exactly the ids of :class:`~pdx.serving.backends.tokenizer.
ByteTokenizer` (0-3 special, 4 + byte) and the presets' chat template, so the same prompt is
the same token ids in pdx's own pair and in the engine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from pdx.errors import InputError
from pdx.serving.backends.base import BackendConfig
from pdx.serving.backends.presets import TINY_CHAT_TEMPLATE, TINY_PRESETS

SPECIAL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>")  # ids 0..3, as ByteTokenizer keeps them
BYTE_OFFSET = len(SPECIAL_TOKENS)
STAMP = "pdx-checkpoint.json"  # written last: a directory without it is incomplete


def checkpoint_dir(cache_dir: Path, preset: str, seed: int) -> Path:
    """Where the export of ``preset`` with ``seed`` lives under ``cache_dir``."""
    return cache_dir / f"{preset}-seed{seed}"


def export_tiny_checkpoint(cache_dir: Path, preset: str = "tiny-llama", seed: int = 0) -> Path:
    """Write (once) the tiny preset as a checkpoint; return its directory.

    The directory is reused when complete (the engine's compile cache is keyed on it), and
    written atomically otherwise (a temporary sibling renamed into place).
    """
    if preset not in TINY_PRESETS:
        raise InputError(
            "vllm.model", preset, f"a checkpoint directory or one of {list(TINY_PRESETS)}"
        )
    target = checkpoint_dir(cache_dir, preset, seed)
    if (target / STAMP).is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
    try:
        _write(tmp, preset, seed)
        try:
            os.rename(tmp, target)
        except OSError:  # another process exported it first
            if not (target / STAMP).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write(out: Path, preset: str, seed: int) -> None:
    from pdx.serving.backends import create_backend

    backend = create_backend(BackendConfig.model_validate({"preset": preset, "seed": seed}))
    model = backend.model  # type: ignore[attr-defined]
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    byte_level_tokenizer().save_pretrained(out)
    stamp = {"preset": preset, "seed": seed, "model_version": backend.model_version}
    (out / STAMP).write_text(json.dumps(stamp))


def byte_level_tokenizer() -> Any:
    """A Hugging Face fast tokenizer with ByteTokenizer's ids and the tiny chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # GPT-2's byte-to-character map: every byte is one visible character of the vocabulary.
    alphabet = _bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({alphabet[b]: BYTE_OFFSET + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        pad_token="<pad>", clean_up_tokenization_spaces=False,
    )  # fmt: skip
    fast.chat_template = TINY_CHAT_TEMPLATE
    return fast


def _bytes_to_unicode() -> dict[int, str]:
    """Byte → printable character, the reversible map byte-level BPE tokenizers use."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]  # fmt: skip
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}
