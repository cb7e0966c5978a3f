"""Tiny model presets: config dicts the ``transformers`` backend builds seeded models from.

Kept free of torch and transformers so readers that only need the layout (``pdx accept``'s
pre-flight, measure-kv) do not pay for importing them.
"""

from __future__ import annotations

from typing import Any

from pdx.errors import InputError

# Tiny configs (Llama architecture) sized so a CPU runs a forward pass in milliseconds.
# Vocabulary 260 = 4 special ids + 256 byte ids (see ByteTokenizer).
TINY_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "vocab_size": 260,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
    "tiny-llama-mha": {
        "vocab_size": 260,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
        "initializer_range": 0.2,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}

TINY_MODEL_TYPE = "llama"  # the architecture every tiny preset uses


def tiny_preset_config(preset: str) -> dict[str, Any]:
    """A copy of a tiny preset's config (kwargs for ``LlamaConfig``); InputError if unknown."""
    if preset not in TINY_PRESETS:
        raise InputError("model.preset", preset, f"one of {', '.join(TINY_PRESETS)}")
    return dict(TINY_PRESETS[preset])


def tiny_config_json(preset: str) -> dict[str, Any]:
    """The preset as a ``config.json``-style dict (with ``model_type``), for measure-kv."""
    return {"model_type": TINY_MODEL_TYPE, **tiny_preset_config(preset)}


# The chat template of every tiny preset (a Jinja2 template, as Hugging Face tokenizers carry
# them): role markers around each message, then the assistant marker for the reply. With the
# byte-level tokenizer the markers are plain bytes, so the prompt is exactly this text.
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
