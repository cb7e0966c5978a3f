"""``pdx measure-kv`` through the CLI: the JSON contract, the must-show figures, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdx.cli.main import app
from pdx.kv.source import load_preset

REQUIRED_KEYS = {
    "model",
    "dtype",
    "kv_bytes_per_token",
    "state_bytes_per_request",
    "layers",
    "requests",
    "codecs",
    "budget",
}


def run(*args: str):
    return CliRunner().invoke(app, ["measure-kv", *args])


def run_json(*args: str) -> dict:
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("preset", "per_token", "has_state"),
    [
        ("llama-3.1-70b", 327680, False),
        ("qwen3-32b", 262144, False),
        ("deepseek-v3", 70272, False),
        ("gemma-3-27b", 81920, False),
        ("qwen3-next-80b-a3b", 24576, True),
        ("jamba-v0.1", 16384, True),
    ],
)
def test_must_show_figures(preset: str, per_token: int, has_state: bool) -> None:
    doc = run_json("--preset", preset, "--dtype", "bf16", "--codecs", "none")
    assert set(doc) >= REQUIRED_KEYS
    assert doc["kv_bytes_per_token"] == per_token
    assert (doc["state_bytes_per_request"] > 0) is has_state
    assert isinstance(doc["kv_bytes_per_token"], int)


def test_json_shape_and_sliding_caps() -> None:
    doc = run_json("--preset", "gemma-3-27b", "--seq", "512,2048", "--codecs", "none")
    assert doc["model"] == "gemma-3-27b" and doc["dtype"] == "bf16"
    assert len(doc["layers"]) == 62
    sliding = [la for la in doc["layers"] if la["kind"] == "sliding"]
    assert len(sliding) == 52 and {la["window_tokens"] for la in sliding} == {1023}
    r512, r2048 = doc["requests"]
    assert r512["seq"] == 512 and r512["kv_bytes"] == 62 * 8192 * 512
    assert r2048["kv_bytes"] == 10 * 8192 * 2048 + 52 * 8192 * 1023
    assert doc["codecs"] == [] and doc["empirical"] is None
    budget = doc["budget"]
    assert {"qps", "link_gbps", "sequences", "break_even", "utilisation_limit"} <= set(budget)


def test_user_config_file_with_empirical_and_codecs(tmp_path: Path) -> None:
    cfg = {
        "model_type": "mistral",
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "sliding_window": 20,
        "vocab_size": 300,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    doc = run_json(
        "--config", str(path), "--seq", "10,100", "--empirical", "--empirical-seq", "40",
        "--codecs", "fp8-e4m3,zstd-planes", "--codec-seq", "32", "--decode-tokens", "2",
    )  # fmt: skip
    assert [e["seq"] for e in doc["empirical"]] == [10, 40]
    assert all(e["match"] for e in doc["empirical"])
    assert doc["empirical"][1]["empirical_bytes"] == 3 * 2 * 2 * 16 * 2 * 19  # run unscaled
    assert doc["empirical"][1]["scaled"] == {}
    names = [c["name"] for c in doc["codecs"]]
    assert names == ["fp8-e4m3", "zstd-planes"]
    for c in doc["codecs"]:
        assert {
            "name",
            "ratio",
            "encode_gbps",
            "decode_gbps",
            "rel_error",
            "token_agreement",
            "kl",
        } <= set(c)
    assert doc["requests"][1]["kv_bytes"] == 3 * 2 * 2 * 16 * 2 * 19


def test_human_table_output() -> None:
    result = run("--preset", "jamba-v0.1", "--codecs", "none")
    assert result.exit_code == 0
    assert "kv_bytes_per_token 16,384" in result.stdout
    assert "Mamba conv 8192x4" in result.stdout


def test_list_presets() -> None:
    doc = run_json("--list-presets")
    assert "qwen3-next-80b-a3b" in doc["presets"] and len(doc["presets"]) == 16
    assert {"llama-4-scout-17b-16e", "falcon-h1-7b-instruct", "lfm2-1.2b"} <= set(doc["presets"])


def _bad_config(tmp_path: Path, name: str, **changes) -> str:
    cfg = dict(load_preset("llama-3.1-8b").config)
    cfg.update(changes)
    for key, value in changes.items():
        if value is None:
            del cfg[key]
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--preset", "llama-3.1-8b", "--seq", "0"], "--seq: got '0'"),
        (["--preset", "llama-3.1-8b", "--seq", "-3"], "--seq"),
        (["--preset", "llama-3.1-8b", "--seq", "many"], "--seq: got 'many'"),
        (["--preset", "llama-3.1-8b", "--codecs", "fp8-e4m3,bogus"], "--codecs: got 'bogus'"),
        (["--preset", "llama-3.1-8b", "--codecs", "foo"], "--codecs: got 'foo', expected one of"),
        (["--preset", "llama-3.1-8b", "--set", "num_hidden_layers"], "--set: got 'num_hidden_"),
        (["--preset", "llama-3.1-8b", "--set", "a b=1"], "--set: got 'a b=1', expected FIELD"),
        (["--preset", "llama-3.1-8b", "--dtype", "int3"], "--dtype: got 'int3'"),
        (["--preset", "jamba-v0.1", "--state-dtype", "fp8"], "--state-dtype"),
        (["--preset", "llama-3.1-8b", "--qps", "0"], "--qps"),
        (["--preset", "llama-3.1-8b", "--link-gbps", "-1"], "--link-gbps"),
        (["--preset", "gpt-5"], "--preset: got 'gpt-5'"),
        (["--seq", "10"], "exactly one of --config, --model-path, --preset"),
        (["--preset", "llama-3.1-8b", "--codec-seq", "0"], "--codec-seq"),
    ],
)
def test_bad_input_one_line_exit_2(args: list[str], needle: str) -> None:
    result = run(*args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0]
    assert "Traceback" not in result.output


def test_bad_config_files(tmp_path: Path) -> None:
    cases = [
        (
            _bad_config(
                tmp_path,
                "a",
                model_type="in_house",
                num_key_value_heads=None,
                num_attention_heads=None,
            ),
            "missing num_attention_heads, num_key_value_heads: ",
        ),
        (_bad_config(tmp_path, "b", model_type="t5"), "'t5' is not a decoder-only"),
        (
            _bad_config(tmp_path, "c", num_hidden_layers="many"),
            "error: num_hidden_layers: got 'many', expected a positive integer",
        ),
    ]
    for path, needle in cases:
        result = run("--config", path, "--codecs", "none")
        assert result.exit_code == 2, result.output
        assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    result = run("--config", str(broken))
    assert result.exit_code == 2 and "--config" in result.stderr


def test_model_path_without_config_json(tmp_path: Path) -> None:
    result = run("--model-path", str(tmp_path))
    assert result.exit_code == 2
    assert "a directory containing config.json" in result.stderr
    result = run("--model-path", str(tmp_path / "missing"))
    assert result.exit_code == 2 and "--model-path" in result.stderr


def test_analytic_cli_is_torch_free_end_to_end() -> None:
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from pdx.cli.main import app\n"
        "args = ['measure-kv', '--preset', 'deepseek-v3', '--codecs', 'none', '--json']\n"
        "r = CliRunner().invoke(app, args)\n"
        "assert r.exit_code == 0, r.output\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_console_script_subprocess() -> None:
    exe = Path(sys.executable).with_name("pdx")
    out = subprocess.run(
        [str(exe), "measure-kv", "--preset", "qwen3-32b", "--codecs", "none", "--json"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv_bytes_per_token"] == 262144


def test_model_path_checkpoint_weights(tmp_path: Path) -> None:
    from pdx.kv.empirical import build_model

    cfg = {
        "model_type": "qwen3",
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "vocab_size": 300,
    }
    build_model(cfg, "fp32").save_pretrained(tmp_path)
    doc = run_json(
        "--model-path", str(tmp_path), "--seq", "24", "--empirical",
        "--codecs", "raw,int8-g64", "--codec-seq", "16", "--decode-tokens", "3",
    )  # fmt: skip
    assert doc["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 2
    (run,) = doc["empirical"]
    assert run["match"] and run["scaled"] == {} and "checkpoint" in run["model_run"]
    assert doc["codec_sample"]["kv_source"].startswith("checkpoint")
    raw, int8 = doc["codecs"]
    assert raw["kl"] == 0.0 and raw["token_agreement"] == 1.0 and int8["kl"] >= 0.0


def test_active_params_override() -> None:
    doc = run_json("--preset", "llama-3.1-8b", "--codecs", "none", "--active-params-b", "1")
    assert doc["params_active"] == 1_000_000_000
    seq = doc["budget"]["sequences"][0]
    assert seq["recompute_s"] == pytest.approx(2 * 1024 * 1e9 / 400e12)
    result = run("--preset", "llama-3.1-8b", "--active-params-b", "-2")
    assert result.exit_code == 2 and "--active-params-b" in result.stderr


def test_engine_vllm_gives_block_rounded_bytes_and_names_its_rules() -> None:
    doc = run_json(
        "--preset", "jamba-v0.1", "--codecs", "none", "--engine", "vllm", "--seq", "1000"
    )
    assert doc["engine"] == "vllm" and doc["block_size"] == 16 and "vLLM" in doc["engine_rules"]
    row = doc["requests"][0]
    assert row["attention_block_size"] == 80 and row["state_page_bytes"] == 327_680
    assert row["kv_bytes"] == 4 * 13 * 80 * 4096 + 28 * 327_680  # cdiv(1000, 80) = 13 blocks
    assert doc["budget"]["sequences"][0]["raw_kv_bytes"] == row["kv_bytes"]
    assert doc["state_dtypes"] == {"conv": "bf16", "recurrent": "bf16"}
    default = run_json("--preset", "jamba-v0.1", "--codecs", "none", "--seq", "1000")
    assert default["engine"] == "transformers" and default["block_size"] is None
    assert default["state_dtypes"] == {"conv": "bf16", "recurrent": "fp32"}


def test_empirical_compares_every_tensor_of_a_hybrid_layer() -> None:
    doc = run_json(
        "--preset", "falcon-h1-7b-instruct", "--codecs", "none", "--empirical",
        "--seq", "24", "--empirical-seq", "24",
    )  # fmt: skip
    row = doc["empirical"][0]
    assert row["match"] and row["mismatches"] == []
    tensors = {t["name"]: t for t in row["layers"][0]["tensors"]}
    assert set(tensors) == {"keys", "values", "conv", "recurrent"}
    assert tensors["conv"]["dtype"] == "bf16" and tensors["recurrent"]["dtype"] == "fp32"
    assert all(t["match"] and t["bytes"] == t["analytic_bytes"] for t in tensors.values())


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--engine", "tgi"], "--engine: got 'tgi'"),
        (["--engine", "vllm", "--block-size", "0"], "--block-size"),
        (["--engine", "vllm", "--device", "tpu"], "--device"),
    ],
)
def test_bad_engine_options(args: list[str], needle: str) -> None:
    result = run("--preset", "llama-3.1-8b", "--codecs", "none", *args)
    assert result.exit_code == 2 and needle in result.stderr


# The Llama-3.1-70B fields a user wrote by hand (the report that started the refusals).
LLAMA_70B = {
    "model_type": "llama", "hidden_size": 8192, "num_attention_heads": 64,
    "num_key_value_heads": 8, "num_hidden_layers": 80, "head_dim": 128,
    "intermediate_size": 28672, "vocab_size": 128256, "torch_dtype": "bfloat16",
}  # fmt: skip
_GONE = object()


def _write(tmp_path: Path, name: str, **changes: object) -> str:
    cfg = {**LLAMA_70B, **changes}
    cfg = {k: v for k, v in cfg.items() if v is not _GONE}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize(
    ("name", "changes", "line"),
    [
        ("no-layers", {"num_hidden_layers": _GONE},
         "error: missing num_hidden_layers: needed to size the KV cache of model_type 'llama' "
         "(add it to the config or pass --set FIELD=VALUE)"),
        ("no-kv-heads", {"num_key_value_heads": _GONE},
         "error: missing num_key_value_heads: needed to size the KV cache of model_type 'llama' "
         "(add it to the config or pass --set FIELD=VALUE)"),
        ("fractional-hidden", {"hidden_size": 8192.5},
         "error: hidden_size: got 8192.5, expected a positive integer"),
        ("kv-heads-7", {"num_key_value_heads": 7},
         "error: num_key_value_heads: got 7, expected a divisor of num_attention_heads (64)"),
        ("kv-heads-negative", {"num_key_value_heads": -8},
         "error: num_key_value_heads: got -8, expected a positive integer"),
        ("kv-heads-word", {"num_key_value_heads": "eight"},
         "error: num_key_value_heads: got 'eight', expected a positive integer"),
        ("head-dim-0", {"head_dim": 0}, "error: head_dim: got 0, expected a positive integer"),
    ],
)  # fmt: skip
def test_hand_written_config_is_refused_not_guessed(
    tmp_path: Path, name: str, changes: dict, line: str
) -> None:
    """The must-show configs: exit 2 and exactly one line naming the field, never a guess."""
    result = run("--config", _write(tmp_path, name, **changes), "--seq", "8k", "--codecs", "none")
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [line]
    assert result.stdout == ""


def test_hand_written_complete_config_gives_327680(tmp_path: Path) -> None:
    doc = run_json("--config", _write(tmp_path, "ok"), "--seq", "8k", "--codecs", "none")
    assert doc["kv_bytes_per_token"] == 327_680
    assert doc["derived"] == {} and doc["overrides"] == {}
    no_dim = run_json(
        "--config", _write(tmp_path, "derived", head_dim=_GONE), "--seq", "8k", "--codecs", "none"
    )
    assert no_dim["kv_bytes_per_token"] == 327_680
    assert no_dim["derived"] == {"head_dim": "head_dim = 128 (hidden_size / num_attention_heads)"}
    assert any("derived: head_dim = 128" in n for n in no_dim["notes"])


def test_a_config_file_names_the_model_after_itself_a_checkpoints_after_its_folder(
    tmp_path: Path,
) -> None:
    assert run_json("--config", _write(tmp_path, "c"), "--codecs", "none")["model"] == "c"
    folder = tmp_path / "llama-3.1-70b-instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_70B))
    doc = run_json("--config", str(folder / "config.json"), "--codecs", "none")
    assert doc["model"] == "llama-3.1-70b-instruct"


def test_set_supplies_what_the_file_lacks(tmp_path: Path) -> None:
    path = _write(tmp_path, "no-layers", num_hidden_layers=_GONE, num_key_value_heads=_GONE)
    result = run("--config", path, "--codecs", "none")
    assert result.exit_code == 2
    assert "missing num_hidden_layers, num_key_value_heads: " in result.stderr
    doc = run_json(
        "--config", path, "--codecs", "none", "--set", "num_hidden_layers=80",
        "--set", "num_key_value_heads=8",
    )  # fmt: skip
    assert doc["kv_bytes_per_token"] == 327_680
    assert doc["overrides"] == {"num_hidden_layers": 80, "num_key_value_heads": 8}
    assert doc["notes"][0].startswith("set with --set")
    bad = run("--config", path, "--codecs", "none", "--set", "num_hidden_layers=80.5",
              "--set", "num_key_value_heads=8")  # fmt: skip
    assert bad.exit_code == 2
    assert bad.stderr.splitlines() == [
        "error: num_hidden_layers: got 80.5, expected a positive integer"
    ]


def test_set_reaches_a_wrappers_text_config() -> None:
    """Gemma-3-4b-it's published config leaves four sizing fields to Gemma3TextConfig."""
    path = Path(__file__).parents[1] / "kv" / "configs" / "gemma-3-4b-it.json"
    result = run("--config", str(path), "--codecs", "none")
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1
    for key in ("num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window_pattern"):
        assert key in result.stderr
    sets = ["num_attention_heads=8", "num_key_value_heads=4", "head_dim=256",
            "sliding_window_pattern=6"]  # fmt: skip
    options = [a for s in sets for a in ("--set", s)]
    doc = run_json("--config", str(path), "--codecs", "none", *options)
    assert doc["kv_bytes_per_token"] == 5 * 4096
    assert doc["layer_counts"] == {"sliding": 29, "full": 5}
