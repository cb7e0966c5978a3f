"""The vLLM engine path without a running engine: config, command line, protocol parsing,
metrics merging, KV sizing, the exported checkpoint and the NIXL idle hook."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdx.errors import ConfigError, InputError
from pdx.netaddr import ephemeral_range
from pdx.procs import group_members
from pdx.serving.deploy_config import load_deploy_config
from pdx.serving.engines import engine_hooks
from pdx.serving.engines import vllm as vllm_engines
from pdx.serving.engines.client import _parse_event, sampling_body, token_logprobs
from pdx.serving.engines.env import EngineUnavailable, VLLMEnv, check
from pdx.serving.engines.metrics import (
    INSTANCE_LABEL,
    engine_counters,
    merge,
    sample_lines,
    sample_sum,
)
from pdx.serving.engines.vllm import (
    CPU_HEAD_SIZES,
    SHM_DIR,
    EngineStartError,
    VLLMEngines,
    check_model_for_device,
    group_gone,
    group_shm,
    head_size,
    kill_group,
    kv_dtype,
    release_shm,
)
from pdx.serving.gateway.engine_app import kv_sizer
from pdx.serving.gateway.protocol import CompletionRequest


def test_engine_is_pdx_by_default_and_vllm_keys_validate() -> None:
    cfg = load_deploy_config()
    assert cfg.engine == "pdx" and cfg.vllm.kv_connector == "NixlConnector"
    cfg = load_deploy_config(dotted=["engine=vllm", "vllm.decode_urls=[http://127.0.0.1:9/]"])
    assert cfg.vllm.external and cfg.vllm.decode_urls == ["http://127.0.0.1:9"]


@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["engine=sglang"], "engine"),
        (["engine=vllm", "vllm.decode_urls=[127.0.0.1:9]"], "vllm.decode_urls"),
        (["vllm.decode_urls=[http://127.0.0.1:9]"], "need engine: vllm"),
        (["engine=vllm", "vllm.prefill_urls=[http://127.0.0.1:9]"], "at least one decode"),
        (["engine=vllm", "vllm.kv_load_failure_policy=retry"], "vllm.kv_load_failure_policy"),
        (["engine=vllm", "vllm.colour=red"], "vllm.colour: unknown key"),
    ],
)
def test_bad_engine_config_names_the_field(sets: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_deploy_config(dotted=sets)
    assert needle in str(err.value)


def test_cpu_attention_head_sizes_are_checked_before_start() -> None:
    from pdx.serving.backends.presets import tiny_config_json

    assert head_size(tiny_config_json("tiny-llama")) == 16
    assert head_size(tiny_config_json("tiny-llama-mha")) in CPU_HEAD_SIZES
    with pytest.raises(InputError, match="head size"):
        check_model_for_device(tiny_config_json("tiny-llama"), "cpu", "tiny-llama")
    check_model_for_device(tiny_config_json("tiny-llama"), "cuda", "tiny-llama")  # GPU kernels


def test_kv_dtype_follows_vllm() -> None:
    assert kv_dtype({"dtype": "float32"}, []) == "bf16"  # vLLM downcasts float32 checkpoints
    assert kv_dtype({"dtype": "float16"}, []) == "fp16"
    assert kv_dtype({"dtype": "bfloat16"}, ["--dtype", "float32"]) == "fp32"
    assert kv_dtype({}, ["--kv-cache-dtype=fp8_e4m3"]) == "fp8"


def _engines(tmp_path: Path, sets: list[str]) -> VLLMEngines:
    cfg = load_deploy_config(dotted=["engine=vllm", *sets])
    engines = VLLMEngines(cfg, tmp_path, cache_dir=tmp_path / "models")
    engines.env = VLLMEnv("/opt/vllm/bin/python", "0.32.0", "1.5.1", "2.13.0", True, 0)
    from pdx.serving.engines.vllm import model_info, resolve_model

    engines.model = model_info(cfg, resolve_model(cfg.vllm, engines.cache_dir))
    cores = [0, 1]
    for k, (role, i) in enumerate([("prefill", 0), ("decode", 0), ("decode", 1)]):
        engines.instances[f"{role}-{i}"] = engines._instance(role, i, k, cores)  # type: ignore[arg-type]
    return engines


def test_command_line_and_environment_of_each_instance(tmp_path: Path) -> None:
    engines = _engines(
        tmp_path, ["vllm.args=[--seed, '7']", "vllm.decode_args=[--max-num-seqs, '4']"]
    )
    p, d0, d1 = (
        engines.instances["prefill-0"],
        engines.instances["decode-0"],
        engines.instances["decode-1"],
    )
    argv = engines.argv(p)
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "NixlConnector", "kv_role": "kv_producer",
                  "kv_buffer_device": "cpu", "kv_load_failure_policy": "fail",
                  "kv_connector_extra_config": {"kv_lease_duration": 30}}  # fmt: skip
    assert "--seed" in argv and "--max-num-seqs" not in argv
    assert json.loads(engines.argv(d0)[engines.argv(d0).index("--kv-transfer-config") + 1])[
        "kv_role"] == "kv_consumer"  # fmt: skip
    assert "--max-num-seqs" in engines.argv(d1)
    env = engines.environ(p)
    assert env["UCX_TLS"] == "tcp,self" and env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert env["PDX_NIXL_PROGRESS_DELAY_US"] == "1000" and env["HF_HUB_OFFLINE"] == "1"
    assert env["PDX_VLLM_SHM_BUSY_LOOP_S"] == "0.02"
    assert env["VLLM_NO_USAGE_STATS"] == "1"
    assert env["PDX_VLLM_COMPILE_KEY_IGNORE"] == "VLLM_NIXL_SIDE_CHANNEL_PORT"
    assert env["PDX_VLLM_AMX"] == "1"
    # One core each, in turn; every instance its own side channel and HTTP port.
    assert [engines.environ(i)["VLLM_CPU_OMP_THREADS_BIND"] for i in (p, d0, d1)] == ["0", "1", "0"]
    # ... and NIXL's worker kept on it (it would move itself to the last core)
    assert [engines.environ(i)["PDX_VLLM_KV_CPUS"] for i in (p, d0, d1)] == ["0", "1", "0"]
    assert len({i.side_channel_port for i in (p, d0, d1)}) == 3
    assert len({i.port for i in (p, d0, d1)}) == 3
    own = _engines(tmp_path, ["vllm.env={VLLM_CPU_OMP_THREADS_BIND: '0-1'}"])
    own_env = own.environ(own.instances["prefill-0"])  # a binding of one's own: left alone
    assert own_env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and "PDX_VLLM_KV_CPUS" not in own_env
    info = engines.describe(p)
    assert info["url"] == f"http://127.0.0.1:{p.port}" and info["kv_endpoint"].startswith(
        "127.0.0.1:"
    )
    assert Path(info["model_path"], "config.json").is_file()


def test_exported_checkpoint_tokenizes_like_the_byte_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from pdx.serving.backends.tokenizer import ByteTokenizer, HFTokenizer
    from pdx.serving.engines.checkpoint import export_tiny_checkpoint

    path = export_tiny_checkpoint(tmp_path, "tiny-llama-mha")
    assert export_tiny_checkpoint(tmp_path, "tiny-llama-mha") == path  # reused, not rewritten
    tok = HFTokenizer(AutoTokenizer.from_pretrained(path, local_files_only=True))
    text = "Grüße, <|user|>\n  世界!"
    assert tok.encode(text) == ByteTokenizer().encode(text)
    assert tok.decode(ByteTokenizer().encode(text)) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == ByteTokenizer().apply_chat_template(msgs)
    config = json.loads((path / "config.json").read_text())
    assert config["head_dim"] == 32 and config["num_hidden_layers"] == 4


def test_kv_bytes_per_request_are_measure_kv_s_vllm_rule() -> None:
    from pdx.kv.engines import vllm_kv_bytes
    from pdx.serving.backends.presets import tiny_config_json

    config = tiny_config_json("tiny-llama-mha")
    size = kv_sizer(config, 128, "cpu", "bf16")
    # 4 layers x (K + V) x 4 heads x 32 x 2 B = 2,048 B per token, whole blocks of 128.
    assert size(311) == 3 * 128 * 2048 == vllm_kv_bytes(config, 311, 128, device="cpu").total_bytes
    assert size(13) == 128 * 2048 and size(128) == 128 * 2048 and size(0) == 0


def _req(**kw: Any) -> CompletionRequest:
    base: dict[str, Any] = {"prompt_ids": [5, 6], "max_tokens": 4, "temperature": 0.0,
                            "seed": 1, "stream": False, "return_token_ids": True,
                            "route": "auto", "user": None, "ignore_eos": False, "model": "m",
                            "kv_codec": ""}  # fmt: skip
    return CompletionRequest(**{**base, **kw})


def test_sampling_parameters_pass_through_in_vllm_names() -> None:
    body = sampling_body(_req(top_k=0, stop=["\n"], logit_bias={7: -100.0}, logprobs=2), 2**64 - 1)
    assert body["top_k"] == -1 and body["stop"] == ["\n"] and body["logit_bias"] == {"7": -100.0}
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert 0 <= body["seed"] < 2**63 and body["max_tokens"] == 4
    assert "logprobs" not in sampling_body(_req(), 1)
    assert "cache_salt" not in sampling_body(_req(), 1)
    assert sampling_body(_req(cache_salt="r1"), 1)["cache_salt"] == "r1"


def test_stream_events_parse() -> None:
    line = b'data: {"choices":[{"index":0,"token_ids":[9,10],"finish_reason":null}]}\n'
    chunk = _parse_event(line)
    assert chunk is not None and chunk.token_ids == [9, 10] and chunk.finish_reason is None
    last = _parse_event(b'data: {"choices":[],"usage":{"prompt_tokens":3}}')
    assert last is not None and last.usage == {"prompt_tokens": 3}
    assert _parse_event(b"\n") is None and _parse_event(b": keep-alive") is None
    from pdx.serving.engines.client import EngineHTTPError

    with pytest.raises(EngineHTTPError):  # vLLM reports a failure inside a started stream
        _parse_event(b'data: {"error": {"message": "KV load failed", "code": 500}}')
    lps = token_logprobs({"tokens": ["token_id:9"], "token_logprobs": [-0.5],
                          "top_logprobs": [{"token_id:9": -0.5, "token_id:4": -1.5}]})  # fmt: skip
    assert lps == [(9, -0.5, [9, 4], [-0.5, -1.5])]


PROM = """# HELP vllm:nixl_bytes_transferred Bytes per NIXL transfer.
# TYPE vllm:nixl_bytes_transferred histogram
vllm:nixl_bytes_transferred_bucket{engine="0",le="+Inf"} 2.0
vllm:nixl_bytes_transferred_count{engine="0"} 2.0
vllm:nixl_bytes_transferred_sum{engine="0"} 1048576.0
# HELP vllm:prompt_tokens_cached_by_source Cached prompt tokens by source.
# TYPE vllm:prompt_tokens_cached_by_source counter
vllm:prompt_tokens_cached_by_source_total{engine="0",source="p2p"} 311.0
vllm:prompt_tokens_cached_by_source_total{engine="0",source="device"} 5.0
"""


def test_engine_metrics_are_merged_with_an_instance_label() -> None:
    text = merge([("prefill-0", PROM), ("decode-0", PROM.replace("311.0", "622.0"))]).decode()
    p2p = [line for line in text.splitlines() if 'source="p2p"' in line]
    assert len(p2p) == 2 and any(f'{INSTANCE_LABEL}="decode-0"' in x and x.endswith(" 622.0")
                                 for x in p2p)  # fmt: skip
    assert text.count("# TYPE vllm:nixl_bytes_transferred histogram") == 1
    assert sample_sum(text, "vllm:nixl_bytes_transferred_sum", pdx_instance="decode-0") == 1048576
    counters = engine_counters(PROM)
    assert counters["p2p_cached_tokens"] == 311 and counters["nixl_transfers"] == 2
    assert merge([("x", "not prometheus {{{")]) == b""


def test_a_series_read_from_its_lines_alone_equals_the_whole_parse() -> None:
    """The gateway's polls read three gauges from ~700 lines; the filtered parse must give
    every series exactly what parsing the whole exposition gives (names that prefix others,
    escaped label values, histogram parts, comments in between)."""
    text = PROM + (
        "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="a \\"q\\" b"} 3.0\n'
        'vllm:num_requests_running_extra{engine="0"} 100.0\n'
        "# a comment line\n"
        'vllm:num_requests_running{engine="1",model_name="x"} 4.0\n'
    )
    full: dict[str, list[tuple[Any, float]]] = {}
    for family in text_string_to_metric_families(text):
        for smp in family.samples:
            full.setdefault(smp.name, []).append((sorted(smp.labels.items()), smp.value))
    for name, samples in full.items():
        alone = [(sorted(smp.labels.items()), smp.value)
                 for family in text_string_to_metric_families(sample_lines(text, name))
                 for smp in family.samples if smp.name == name]  # fmt: skip
        assert sorted(alone) == sorted(samples), name
        assert sample_sum(text, name) == sum(v for _, v in samples)
    assert sample_sum(text, "vllm:num_requests_running") == 7.0  # not the _extra series
    # only those series' sample lines are kept: no comments, no other series
    kept = sample_lines(text, "vllm:num_requests_running").splitlines()
    assert len(kept) == 3 and all(line.startswith("vllm:num_requests_running") for line in kept)
    assert sample_sum(text, "vllm:num_requests_running", model_name='a "q" b') == 3.0


def test_nixl_hook_sets_the_progress_delay_only_when_asked() -> None:
    made: list[tuple[str, int]] = []

    class Config:
        pthrDelay = 0  # NIXL's name

    def agent(name: str, cfg: Config) -> str:
        made.append((name, cfg.pthrDelay))
        return name

    api = types.ModuleType("nixl_cu12._api")
    api.nixlBind = types.SimpleNamespace(nixlAgent=agent, other=1)  # type: ignore[attr-defined]
    assert not engine_hooks.patch_nixl(api, 0)  # no delay asked: NIXL unchanged
    assert engine_hooks.patch_nixl(api, 10_000)
    assert not engine_hooks.patch_nixl(api, 10_000)  # once
    assert api.nixlBind.nixlAgent("a", Config()) == "a" and api.nixlBind.other == 1
    assert made == [("a", 10_000)]


def test_a_missing_engine_environment_says_why(tmp_path: Path) -> None:
    with pytest.raises(EngineUnavailable, match="make vllm"):
        check(tmp_path / "no-such-python")
    # pdx's own interpreter is a real Python without vLLM in it.
    with pytest.raises(EngineUnavailable, match="vLLM is not installed"):
        check(Path(sys.executable))


def test_shm_hook_shortens_the_readers_busy_window_only() -> None:
    class SpinCondition:  # the shape of vLLM's shm_broadcast.SpinCondition
        def __init__(self, is_reader: bool, busy_loop_s: float = 1) -> None:
            self.is_reader = is_reader
            self.busy_loop_s = busy_loop_s if is_reader else 0

    shm = types.ModuleType("vllm.distributed.device_communicators.shm_broadcast")
    shm.SpinCondition = SpinCondition  # type: ignore[attr-defined]
    assert engine_hooks.patch_shm(shm, 0.02) and not engine_hooks.patch_shm(shm, 0.02)
    assert SpinCondition(is_reader=True).busy_loop_s == 0.02
    assert SpinCondition(is_reader=False).busy_loop_s == 0
    assert any(p.match(shm.__name__) for p, _, _ in engine_hooks.HOOKS)
    shm.SHM_READER_RECHECK_INTERVAL_MS = 5000  # type: ignore[attr-defined]
    assert engine_hooks.patch_recheck(shm, 50) and shm.SHM_READER_RECHECK_INTERVAL_MS == 50


def test_compile_key_hook_leaves_the_side_channel_port_out_of_the_cache_key() -> None:
    """Two instances on different side-channel ports get one compile cache key."""
    port = {"value": 5600}

    def compile_factors() -> dict[str, object]:  # the shape of vllm.envs.compile_factors
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": port["value"], "VLLM_CPU_OMP_THREADS_BIND": "0"}

    envs = types.ModuleType("vllm.envs")
    envs.compile_factors = compile_factors  # type: ignore[attr-defined]
    assert not engine_hooks.patch_compile_key(envs, set())  # nothing asked: vLLM's key
    assert engine_hooks.patch_compile_key(envs, {"VLLM_NIXL_SIDE_CHANNEL_PORT"})
    assert not engine_hooks.patch_compile_key(envs, {"VLLM_NIXL_SIDE_CHANNEL_PORT"})  # once
    first = envs.compile_factors()
    port["value"] = 41234
    assert envs.compile_factors() == first == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert any(p.match(envs.__name__) for p, _, _ in engine_hooks.HOOKS)


async def test_a_killed_group_is_waited_for_until_no_process_of_it_lives() -> None:
    """What a restart waits for: the old instance's whole group gone (zombies do not count),
    a group that will not go reported after the wait."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 10
        while len(group_members(proc.pid)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert proc.pid in group_members(proc.pid) and len(group_members(proc.pid)) == 2
        assert not await group_gone(proc.pid, 0.3)  # alive: the wait ends, saying so
        assert kill_group(proc.pid)
        assert await group_gone(proc.pid, 10)
        assert group_members(proc.pid) == []
    finally:
        kill_group(proc.pid)
        await proc.wait()


async def test_a_killed_groups_shared_memory_is_removed_and_no_other() -> None:
    """A SIGKILLed group's psm_* segment stays in /dev/shm (its resource tracker dies with it)
    until pdx removes it: only once the group is gone, and never a segment a live process
    still maps (here one this test holds)."""
    from multiprocessing import shared_memory

    code = ("import time; from multiprocessing import shared_memory as s; "
            "m = s.SharedMemory(create=True, size=1 << 20); print(m.name, flush=True); "
            "time.sleep(30)")  # fmt: skip
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", code,
                                                stdout=asyncio.subprocess.PIPE,
                                                start_new_session=True)  # fmt: skip
    assert proc.stdout is not None
    held, name = shared_memory.SharedMemory(create=True, size=4096), ""
    try:
        name = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode().strip()
        assert name.startswith("psm_") and (SHM_DIR / name).exists()
        names = group_shm(proc.pid)
        assert names == {name}
        assert release_shm(proc.pid, names | {held.name}) == []  # the group lives: nothing
        assert kill_group(proc.pid) and await group_gone(proc.pid, 10)
        assert (SHM_DIR / name).exists()  # killed: nobody unlinked it
        assert release_shm(proc.pid, names | {held.name}) == [name]
        assert not (SHM_DIR / name).exists() and (SHM_DIR / held.name).exists()
    finally:
        kill_group(proc.pid)
        await proc.wait()
        held.close()
        for left in (held.name, name):
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / left).unlink() if left else None


def test_kv_cpus_hook_keeps_nixls_worker_on_the_instances_own_cores() -> None:
    """NIXL's CPU worker pins itself to the machine's last core; with the hook it stays on
    the cores pdx gave the instance (checked on this thread's real affinity)."""
    worker = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")
    worker.os = os  # type: ignore[attr-defined]
    own = {min(os.sched_getaffinity(0))}
    last = {max(os.sched_getaffinity(0))}
    assert not engine_hooks.patch_kv_cpus(worker, set())  # nothing asked: vLLM's choice
    assert engine_hooks.patch_kv_cpus(worker, own)
    assert not engine_hooks.patch_kv_cpus(worker, own)  # once
    assert worker.os.path is os.path and worker.os.getpid() == os.getpid()  # the rest is os
    before = os.sched_getaffinity(0)

    def pinned_as_nixl_asks() -> set[int]:
        # what base_worker does from its main thread, here in a thread of its own
        worker.os.sched_setaffinity(0, last)
        return os.sched_getaffinity(0)

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(pinned_as_nixl_asks).result() == own
    assert os.sched_getaffinity(0) == before  # only that thread moved
    assert any(p.match(worker.__name__) for p, _, _ in engine_hooks.HOOKS)
    assert engine_hooks.KV_CPUS_ENV == vllm_engines.KV_CPUS_ENV  # the name pdx sets


_XCOMP_PERM = """
import ctypes, os, sys, types
libc = ctypes.CDLL(None, use_errno=True)
def granted() -> bool:  # arch_prctl(ARCH_GET_XCOMP_PERM): bit 18 is AMX's tile data
    bits = ctypes.c_uint64()
    libc.syscall(158, 0x1022, ctypes.byref(bits))
    return bool(bits.value >> 18 & 1)
import torch
from pdx.serving.engines import engine_hooks
before = granted()
engine_hooks._amx(types.ModuleType("vllm.v1.attention.backends.cpu_attn"))
print(before, granted())
"""


def test_amx_hook_asks_the_kernel_for_the_tile_state_before_vllms_attention() -> None:
    """vLLM's bf16 CPU attention runs AMX instructions where the CPU lists AMX, but never
    asks Linux for the permission: under --enforce-eager the first KV-loaded step died of
    SIGILL. The hook asks for it (checked through the kernel's own answer, in a fresh
    process: a permission once granted stays for the process's life)."""
    if "amx_tile" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("this CPU has no AMX")
    env = {**os.environ, engine_hooks.AMX_ENV: "1"}
    run = [sys.executable, "-c", _XCOMP_PERM]
    out = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"], out
    env.pop(engine_hooks.AMX_ENV)  # not asked: not requested
    out = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"], out
    assert any(p.match("vllm.v1.attention.backends.cpu_attn") for p, _, _ in engine_hooks.HOOKS)


def test_kv_failure_hook_records_each_request_whose_load_failed(tmp_path: Path) -> None:
    class Scheduler:  # the shape of vLLM's v1 Scheduler around a failed KV load
        def __init__(self, recompute: bool) -> None:
            self.recompute_kv_load_failures = recompute
            self.failed_recving_kv_req_ids: set[str] = set()

        def _handle_failed_recving(self, ids: set[str]) -> set[str]:
            if self.recompute_kv_load_failures:
                self.failed_recving_kv_req_ids |= ids
                return set()
            return set(ids)

        def _handle_invalid_blocks(self, blocks: set[int], scheduled: dict[str, int]) -> set[str]:
            return {f"sync-{b}" for b in blocks}

    sched = types.ModuleType("vllm.v1.core.sched.scheduler")
    sched.Scheduler = Scheduler  # type: ignore[attr-defined]
    path = tmp_path / "decode-0.kv-load-failures.jsonl"
    assert engine_hooks.patch_kv_failures(sched, str(path))
    assert not engine_hooks.patch_kv_failures(sched, str(path))  # once
    assert any(p.match(sched.__name__) for p, _, _ in engine_hooks.HOOKS)
    quiet = Scheduler(recompute=True)
    assert quiet._handle_failed_recving({"cmpl-a-0-d"}) == set()  # vLLM's answer unchanged
    assert quiet._handle_invalid_blocks({7}, {}) == {"sync-7"}
    Scheduler(recompute=False)._handle_failed_recving({"cmpl-b-0-d"})
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["hook"] == "kv_load_failures"
    assert [(r["request_id"], r["policy"]) for r in lines[1:]] == [
        ("cmpl-a-0-d", "recompute"), ("sync-7", "recompute"), ("cmpl-b-0-d", "fail")]  # fmt: skip


class _Child:
    """The supervisor's view of one instance, as spawn() reads and fills it."""

    def __init__(self, name: str) -> None:
        self.role, _, idx = name.partition("-")
        self.index = int(idx)
        self.proc: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}
        self.log_path: Path | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


async def test_a_restart_that_never_gets_ready_is_given_up_at_the_restart_bound(
    tmp_path: Path,
) -> None:
    """A first start may take ready_timeout_s (a compile); a restart that wedges (an instance
    that never answers /health) is given up after restart_ready_timeout_s, so the supervisor
    kills it and starts another instead of keeping the site out for the whole first bound."""
    engines = _engines(
        tmp_path,
        [
            "vllm.ready_timeout_s=60",
            "vllm.restart_ready_timeout_s=1",
            f"vllm.log_dir={tmp_path / 'logs'}",
        ],
    )
    wedged = tmp_path / "python"
    wedged.write_text("#!/bin/sh\nexec sleep 30\n")  # an interpreter that never serves
    wedged.chmod(0o755)
    assert engines.env is not None
    engines.env = dataclasses.replace(engines.env, python=str(wedged))
    child = _Child("prefill-0")
    child.proc = await asyncio.create_subprocess_exec("true", start_new_session=True)
    await child.proc.wait()  # the instance that crashed
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineStartError, match="not healthy within 1 s"):
            await engines.spawn(child)
        assert time.monotonic() - t0 < 10
    finally:
        assert child.proc is not None
        kill_group(child.proc.pid)
        await child.proc.wait()
        engines.close()


async def test_polled_answers_past_the_cap_are_not_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """/metrics and /v1/models of an instance are bounded: a body over MAX_POLL_BYTES, whether
    its Content-Length says so or it streams on without one, reads as no answer."""
    from aiohttp import ClientSession, web
    from local_app import serving

    from pdx.serving.engines import client as engine_client

    monkeypatch.setattr(engine_client, "MAX_POLL_BYTES", 4096)
    sent: dict[str, int] = {}

    async def endless(request: web.Request) -> web.StreamResponse:  # chunked, no length
        resp = web.StreamResponse()
        await resp.prepare(request)
        sent["chunked"] = 0
        for _ in range(64):  # 64 KiB, bounded
            await resp.write(b"# " + b"x" * 1021 + b"\n")
            sent["chunked"] += 1024
        return resp

    big = {"data": [{"id": "m" * 100} for _ in range(100)]}  # ~11 KB with a Content-Length
    routes = {"/a/metrics": lambda r: web.Response(text="pdx_up 1\n"),
              "/a/v1/models": lambda r: web.json_response({"data": [{"id": "tiny"}]}),
              "/b/metrics": endless, "/b/v1/models": lambda r: web.json_response(big)}  # fmt: skip
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    async with serving(app) as url, ClientSession() as s:
        c = engine_client.EngineClient(s, "tiny")
        ok, bad = f"{url}/a", f"{url}/b"
        assert await c.metrics_text(ok) == "pdx_up 1\n"
        assert await c.served_models(ok) == ["tiny"]
        assert await c.metrics_text(bad) is None
        assert await c.served_models(bad) == []
        assert f"{bad}/metrics" in engine_client._OVERSIZED
        assert f"{bad}/v1/models" in engine_client._OVERSIZED


# An instance whose HTTP listener runs in a thread and dies if its port is taken, leaving the
# process up and silent (as vLLM's NIXL handshake listener did): the error is asyncio's own.
_LISTENER_DIES = """\
import asyncio, sys, threading, time
from aiohttp import web
host = sys.argv[sys.argv.index("--host") + 1]
port = int(sys.argv[sys.argv.index("--port") + 1])
async def main():
    app = web.Application()
    app.router.add_get("/health", lambda r: web.Response(text="ok"))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    await asyncio.sleep(60)
threading.Thread(target=asyncio.run, args=(main(),), daemon=True).start()
time.sleep(60)
"""


async def _held(host: str, port: int) -> socket.socket:
    s = socket.socket()
    s.bind((host, port))
    s.listen()
    return s


async def test_a_port_taken_before_the_instance_binds_it_moves_a_first_start_only(
    tmp_path: Path,
) -> None:
    """The port picked for an instance is taken by someone else before the instance binds it:
    its start fails at once (not after ready_timeout_s), and a first start goes again on
    fresh ports; a restart keeps its ports (peers know them) and says which was taken."""
    engines = _engines(tmp_path, ["vllm.ready_timeout_s=60", f"vllm.log_dir={tmp_path}"])
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{_LISTENER_DIES}")
    script.chmod(0o755)
    assert engines.env is not None
    engines.env = dataclasses.replace(engines.env, python=str(script))
    first = engines.instances["prefill-0"]
    child = _Child("prefill-0")
    thief = await _held(first.host, first.port)
    try:
        t0 = time.monotonic()
        await engines.spawn(child)
        took = time.monotonic() - t0
        moved = engines.instances["prefill-0"]
        assert moved.port != first.port and child.info["port"] == moved.port
        assert took < 20  # two starts of a small script, not the 60 s bound
        assert "already in use" in (tmp_path / "prefill-0.log").read_text().lower()
        lo, hi = ephemeral_range()
        assert not lo <= moved.port <= hi and not lo <= moved.side_channel_port <= hi
        # a restart on the same ports, one of them taken meanwhile: fails fast, names it
        assert child.proc is not None
        kill_group(child.proc.pid)
        await child.proc.wait()
        assert await group_gone(child.proc.pid, 10)
        thief.close()
        thief = await _held(moved.host, moved.port)
        t0 = time.monotonic()
        with pytest.raises(vllm_engines.PortTakenError, match=f"port {moved.port} was taken"):
            await engines.spawn(child)
        assert time.monotonic() - t0 < 20 and engines.instances["prefill-0"] == moved
    finally:
        thief.close()
        if child.proc is not None:
            kill_group(child.proc.pid)
            await child.proc.wait()
        engines.close()


# An instance that leaves what vLLM's processes leave in their temporary directory: a Unix
# socket (its ZMQ IPC endpoints) and a rendezvous file (torch.distributed's), then serves.
_LEAVES_TMP = """\
import os, socket, sys, tempfile, uuid
from aiohttp import web
tmp = tempfile.gettempdir()
s = socket.socket(socket.AF_UNIX)
s.bind(os.path.join(tmp, str(uuid.uuid4())))
open(os.path.join(tmp, "vllm_dist_" + uuid.uuid4().hex), "w").close()
print("TMP", tmp, "INDUCTOR", os.environ.get("TORCHINDUCTOR_CACHE_DIR"), flush=True)
port = int(sys.argv[sys.argv.index("--port") + 1])
app = web.Application()
app.router.add_get("/health", lambda r: web.Response(text="ok"))
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


@pytest.mark.parametrize("long_work_dir", [False, True])
async def test_what_an_instance_leaves_in_its_tmpdir_goes_with_it(
    tmp_path: Path, long_work_dir: bool
) -> None:
    """Each instance gets a TMPDIR of its own (a short one where the work directory's would
    not hold a Unix socket's name), torch's compile cache stays where it was, and the
    directory is gone once the instance's process group is."""
    import tempfile

    # pytest's own directories are already too long for the instance's socket names
    short = tempfile.TemporaryDirectory(prefix="pdx-test-")
    work = tmp_path / ("w" * 40) if long_work_dir else Path(short.name)
    work.mkdir(exist_ok=True)
    engines = _engines(work, [f"vllm.log_dir={tmp_path}"])
    script = tmp_path / "python"
    script.write_text(f"#!{sys.executable}\n{_LEAVES_TMP}")
    script.chmod(0o755)
    assert engines.env is not None
    engines.env = dataclasses.replace(engines.env, python=str(script))
    child = _Child("decode-0")
    try:
        await engines.spawn(child)
        tmp = engines.instance_tmp("decode-0")
        assert tmp.is_relative_to(work) != long_work_dir
        left = sorted(p.name for p in tmp.iterdir())
        assert len(left) == 2 and any(n.startswith("vllm_dist_") for n in left)
        said = (tmp_path / "decode-0.log").read_text().split()
        assert said[said.index("TMP") + 1] == str(tmp)
        inductor = said[said.index("INDUCTOR") + 1]
        assert inductor.startswith(tempfile.gettempdir() + "/torchinductor_")
    finally:
        assert child.proc is not None
        kill_group(child.proc.pid)
        await child.proc.wait()
    assert await group_gone(child.proc.pid, 10)
    await engines.release_leftovers("decode-0")
    assert not tmp.exists()
    engines.close()
    assert not tmp.parent.exists() or not long_work_dir
    short.cleanup()


def test_the_log_watch_reads_only_this_starts_lines_whole(tmp_path: Path) -> None:
    """What an earlier start wrote is not read; a line split across two reads is read whole;
    progress bars' carriage returns end a line; another port holding the digits is not it."""
    log = tmp_path / "prefill-0.log"
    log.write_bytes(b"an earlier start: address already in use on port 4242\n")
    watch = vllm_engines._LogWatch(log, log.stat().st_size, (4242, 0))
    assert watch.port_taken() is None
    with log.open("ab") as f:
        f.write(b"Loading 10%\rLoading 100%\rport 14242 already in use\nbind ('127.0.0.1', 42")
    assert watch.port_taken() is None  # 14242 is another port; the last line is half here
    with log.open("ab") as f:
        f.write(b"42): address already in use\n")
    port, line = watch.port_taken() or (0, "")
    assert port == 4242 and line.startswith("bind ('127.0.0.1', 4242)")


def test_decodes_publish_kv_events_on_a_unix_socket_prefill_does_not(tmp_path: Path) -> None:
    engines = _engines(tmp_path, [])
    p, d0 = engines.instances["prefill-0"], engines.instances["decode-0"]
    argv = engines.argv(d0)
    conf = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert conf == {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv-events",
                    "endpoint": f"ipc://{engines.instance_tmp('decode-0')}/kv-events"}  # fmt: skip
    assert "--enable-prompt-tokens-details" in argv
    assert engines.describe(d0)["kv_events"] == conf["endpoint"]
    assert "--kv-events-config" not in engines.argv(p) and "kv_events" not in engines.describe(p)
    off = _engines(tmp_path, ["vllm.kv_events=false"])
    assert "--kv-events-config" not in off.argv(off.instances["decode-0"])
