"""Published config.json files of current models (tests/kv/configs/, sources in its README).

Each is sized without error, through transformers' configuration classes, for both engines;
the figures below are worked out by hand from the configs' fields. Reading them in a child
process without torch gives the same result as reading them in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdx.errors import UnsupportedModelError
from pdx.kv.engines import vllm_kv_bytes
from pdx.kv.hfconfig import resolve_in_process
from pdx.kv.source import ModelSource, apply_overrides
from pdx.kv.spec import build_spec

CONFIGS = Path(__file__).parent / "configs"
NAMES = sorted(p.stem for p in CONFIGS.glob("*.json"))


#: Fields a published config leaves to its class's defaults, given as ``--set`` would give them
#: (Gemma 3 4B's values; pdx refuses the bare file, see below).
FILLED = {
    "gemma-3-4b-it": {
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "sliding_window_pattern": 6,
    },
}  # fmt: skip


def published(name: str) -> dict[str, Any]:
    """The file exactly as published."""
    config: dict[str, Any] = json.loads((CONFIGS / f"{name}.json").read_text())
    return config


def load(name: str) -> dict[str, Any]:
    """The published file plus the fields in :data:`FILLED`, as ``--set`` adds them."""
    source = ModelSource(name, published(name))
    return apply_overrides(source, FILLED.get(name, {})).config


def test_a_published_config_that_leaves_sizes_to_class_defaults_is_refused() -> None:
    with pytest.raises(UnsupportedModelError) as err:
        build_spec(published("gemma-3-4b-it"), name="g")
    message = str(err.value)
    assert message.startswith("missing ") and "\n" not in message
    assert all(key in message for key in FILLED["gemma-3-4b-it"])


def test_at_least_ten_current_models() -> None:
    assert len(NAMES) >= 10
    readme = (CONFIGS / "README.md").read_text()
    assert all(f"`{name}.json`" in readme for name in NAMES)  # every source is noted


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("engine", ["transformers", "vllm"])
def test_every_published_config_is_sized(name: str, engine: str) -> None:
    spec = build_spec(load(name), name=name, engine=engine)
    assert spec.kv_bytes(32768) > spec.kv_bytes(1) > 0
    assert not [la for la in spec.layers if la.kind != "none" and la.bytes_for(1) == 0]
    if engine == "vllm":
        assert vllm_kv_bytes(spec, 32768).total_bytes > 0


# bf16, transformers: (growing bytes/token, sliding bytes/token, window kept, state bytes)
EXPECTED = {
    "llama-4-scout-17b-16e": (12 * 4096, 36 * 4096, 8191, 0),
    "phi-3-mini-4k-instruct": (0, 32 * 2 * 32 * 96 * 2, 2046, 0),
    "gemma-3-4b-it": (5 * 4096, 29 * 4096, 1023, 0),
    "lfm2-1.2b": (6 * 2048, 0, None, 10 * 2048 * 3 * 2),
    # Mamba-2: conv (3072 + 2*1*256) x 4 in bf16, ssm 24 x 128 x 256 in fp32, 44 layers
    "falcon-h1-7b-instruct": (44 * 1024, 0, None, 44 * (3584 * 4 * 2 + 24 * 128 * 256 * 4)),
    "kimi-k2.6": (61 * 576 * 2, 0, None, 0),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hand_worked_sizes(name: str) -> None:
    growing, sliding, window, state = EXPECTED[name]
    spec = build_spec(load(name), name=name)
    assert spec.kv_bytes_per_token == growing
    assert spec.sliding_bytes_per_token == sliding
    windows = {la.window_tokens for la in spec.layers if la.kind == "sliding"}
    assert windows == ({window} if window else set())
    assert spec.state_bytes_per_request == state


def test_llama4_chunked_layers_in_vllm_keep_only_the_current_chunk() -> None:
    spec = build_spec(load("llama-4-scout-17b-16e"), name="l4", engine="vllm")
    sizing = vllm_kv_bytes(spec, 3 * 8192 + 100, 16)  # 100 tokens into the fourth chunk
    chunked = [la for la in sizing.layers if la.kind == "sliding"]
    assert {la.blocks for la in chunked} == {-(-100 // 16)}
    full = [la for la in sizing.layers if la.kind == "full"]
    assert {la.blocks for la in full} == {-(-(3 * 8192 + 100) // 16)}


def test_reading_without_torch_gives_the_same_config() -> None:
    """The child process (torch hidden) and this process read every config alike."""
    code = (
        "import json, sys\n"
        "sys.modules['torch'] = None\n"
        "from pdx.kv.hfconfig import resolve_in_process\n"
        "configs = json.load(sys.stdin)\n"
        "print(json.dumps([resolve_in_process(c) for c in configs]))\n"
    )
    configs = [load(n) for n in NAMES]
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps(configs),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    child = json.loads(out.stdout.strip().splitlines()[-1])
    here = json.loads(json.dumps([resolve_in_process(c) for c in configs]))
    for name, a, b in zip(NAMES, child, here, strict=True):
        assert a.get("model_type") == b.get("model_type"), name
        assert a.get("text", {}).get("layer_types") == b.get("text", {}).get("layer_types"), name
        for key in ("num_key_value_heads", "head_dim", "num_hidden_layers", "sliding_window"):
            assert a.get("text", {}).get(key) == b.get("text", {}).get(key), (name, key)
